"""In-process server checks: generated request bodies never get a 5xx, the engine thread's death
errors every caller at once, and CORS is opt-in. One tiny-model server thread for the module."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.model_helpers import tiny_model_dir
from test_server import ServerThread

from lmport.config import EngineConfig
from lmport.engine.core import EngineCore
from lmport.engine.engine import Engine
from lmport.server.app import create_app

ORIGIN = "https://allowed.example"


@pytest.fixture(scope="module")
def fuzz_server():
    # A short session bounds what a generated valid request can cost.
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=64, session_len=48))
    server = ServerThread(create_app(engine, model_name="tiny",
                                     cors_origins=[ORIGIN]))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        server.http = http
        yield server
    server.stop()


text = st.text(max_size=12)
number = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=False),
                   st.sampled_from([0, 1, -1, 1e-300, 1e300, 1e-320, 2**63, 49152, 49153]))
json_value = st.recursive(st.none() | st.booleans() | number | text,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                          max_leaves=8)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"])},
                                optional={"content": st.one_of(text, st.none(), number,
                                                               st.lists(st.fixed_dictionaries(
                                                                   {"type": st.just("text"), "text": text})))})
FIELDS = {
    "model": st.sampled_from(["tiny", "tiny", "tiny", "", "other"]),
    "max_tokens": st.one_of(st.integers(-3, 40), number), "temperature": number, "top_p": number,
    "top_k": number, "min_p": number, "repetition_penalty": number, "n": st.integers(-1, 20), "seed": number,
    "stop": st.one_of(st.none(), text, st.lists(text, max_size=18)), "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": st.booleans(), "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
    "top_logprobs": st.integers(-1, 25), "presence_penalty": number, "logit_bias": json_value,
    "best_of": json_value, "echo": st.booleans(), "user": json_value,
}
prompt = st.one_of(text, st.lists(text, max_size=4), st.lists(st.integers(-5, 50_000), max_size=8),
                   st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=5), max_size=3), json_value)
chat_body = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3), json_value)},
                                  optional=FIELDS)
completion_body = st.fixed_dictionaries({"prompt": prompt}, optional=FIELDS)
body = st.one_of(st.tuples(st.just("/v1/chat/completions"), chat_body),
                 st.tuples(st.just("/v1/completions"), completion_body),
                 st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), json_value))


def _check(server, path, payload) -> None:
    content = json.dumps(payload).encode()
    with server.http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
        data = r.read().decode()
    assert r.status_code < 500, (r.status_code, data[:500])
    if r.status_code == 200 and data.startswith("data:"):
        assert data.rstrip().endswith("data: [DONE]") and '"server_error"' not in data, data[-500:]


def _fuzz(server, examples: int):
    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body)
    def run(case):
        _check(server, *case)
    run()
    assert server.http.get("/health").status_code == 200
    deadline = time.monotonic() + 60   # a hang guard
    while server.server.config.app.state.frontend.core.snapshot["blocks_used"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_fuzzed_bodies_never_get_a_5xx(fuzz_server):
    _fuzz(fuzz_server, 200)


@pytest.mark.slow
def test_fuzzed_bodies_never_get_a_5xx_thousands(fuzz_server):
    _fuzz(fuzz_server, 3000)


def test_cors_only_for_the_given_origins(fuzz_server):
    def preflight(origin):
        return fuzz_server.http.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"})
    assert preflight(ORIGIN).headers.get("access-control-allow-origin") == ORIGIN
    assert "access-control-allow-origin" not in preflight("https://other.example").headers


def test_a_dead_engine_thread_errors_every_caller_and_turns_the_server_away():
    engine = EngineCore(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=64))
    server = ServerThread(create_app(engine, model_name="tiny"))
    app_server = server.server.config.app.state.frontend
    fail = threading.Event()
    real_step = engine.step

    def step():
        if fail.is_set():
            raise RuntimeError("injected engine fault")
        return real_step()

    engine.step = step
    body = {"model": "tiny", "prompt": "a", "max_tokens": 1500, "ignore_eos": True}
    results = []
    # The first forward is slow (allocator, kernels): not part of what is timed below.
    httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=120)

    def call(stream):
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": stream}, timeout=120) as r:
            results.append((r.status_code, r.read().decode()))

    try:
        threads = [threading.Thread(target=call, args=(i % 2 == 0,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while app_server.core.snapshot["running"] + app_server.core.snapshot["waiting"] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        fail.set()
        for t in threads:
            t.join(60)   # the fault ends them at once; this only guards against a hang
        assert len(results) == 6
        for status, data in results:
            assert "injected engine fault" in data
            assert status == 500 or (status == 200 and data.rstrip().endswith("data: [DONE]"))
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        health = httpx.get(server.url + "/health", timeout=60)
        assert health.status_code == 503 and "injected engine fault" in health.json()["reason"]
    finally:
        server.stop()
