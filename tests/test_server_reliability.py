"""Reliability and safety of `lmport serve`, against real server subprocesses on loopback.

One shared server (tiny random-weight model, API key, max_batch_size 1,
max_waiting_requests 4, short header/body timeouts) takes every "bad
request" case in turn; after each, a normal request must succeed and
/metrics must be back to 0 running, 0 waiting and 0 KV blocks. Three more
subprocesses are shut down on purpose: one by SIGTERM with 20 streams in
flight, one by a fault injected into Engine.step (it must exit non-zero),
and one whose engine core process is killed mid-stream. All four start
together, so their start-ups overlap.

No outcome depends on how fast the machine is: each server runs HOOKS_SCRIPT, with which a test holds the
engine's steps, or the front end's tokenizing, while it looks (``Serve.hold``); timeouts only guard against
hangs.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.model_helpers import tiny_model_dir
from support.serve_process import ServeProcess

KEY = "sk-reliability"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHUTDOWN_TIMEOUT = 3.0
WAIT = 60   # seconds: a guard against hangs, never what a test measures

# `lmport serve` with two hooks, each switched by a file the test creates: while LMPORT_TEST_HOLD_<WHAT>
# exists, each engine step ("steps", in the engine core process) or each tokenizing call of the front end
# ("tokenize") waits, after creating <file>.waiting; once LMPORT_TEST_FAULT_FILE exists, every step raises.
HOOKS_SCRIPT = r"""
import os, sys, time
from lmport.engine.core import EngineCore
from lmport.server.frontend import Frontend

def hold(what):
    path = os.environ[f"LMPORT_TEST_HOLD_{what.upper()}"]
    if os.path.exists(path):
        open(path + ".waiting", "w").close()
        while os.path.exists(path):
            time.sleep(0.01)

real_step = EngineCore.step

def step(self):
    hold("steps")
    if os.path.exists(os.environ["LMPORT_TEST_FAULT_FILE"]):
        raise RuntimeError("injected engine fault")
    return real_step(self)

real_tokenize = Frontend.tokenize

async def tokenize(self, fn, *args):
    def held(*a):
        hold("tokenize")
        return fn(*a)
    return await real_tokenize(self, held, *args)

EngineCore.step = step
Frontend.tokenize = tokenize
from lmport.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Serve(ServeProcess):
    """`lmport serve` (the tiny model) under HOOKS_SCRIPT, in a subprocess on a loopback port the OS picks."""

    def __init__(self, tmp: Path, name: str, *flags: str):
        self.files = {what: tmp / f"{name}.{what}" for what in ("steps", "tokenize", "fault")}
        env = {"LMPORT_TEST_FAULT_FILE": str(self.files["fault"]), "OMP_NUM_THREADS": "1",   # a small machine
               **{f"LMPORT_TEST_HOLD_{what.upper()}": str(self.files[what]) for what in ("steps", "tokenize")}}
        super().__init__([sys.executable, "-c", HOOKS_SCRIPT],
                         [tiny_model_dir("llama"), "--host", "127.0.0.1", "--cache-max-entry-count", "64", *flags],
                         tmp / f"{name}.log", env=env)

    @contextlib.contextmanager
    def hold(self, what: str):
        """While the block runs, each engine step (``what="steps"``) or tokenizing call (``"tokenize"``) waits,
        from the next one on; yields a function that waits until one does."""
        path = self.files[what]
        waiting = Path(f"{path}.waiting")
        waiting.unlink(missing_ok=True)
        path.touch()

        def reached() -> None:
            deadline = time.monotonic() + WAIT
            while not waiting.exists():
                assert time.monotonic() < deadline, f"no {what} call waited:\n{self.log.read_text()}"
                time.sleep(0.01)

        try:
            yield reached
        finally:
            path.unlink()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reliability")
    started = {
        "shared": Serve(tmp, "shared", "--api-key", KEY, "--max-batch-size", "1", "--max-waiting-requests", "4",
                        "--header-timeout", "1", "--body-timeout", "2"),
        "sigterm": Serve(tmp, "sigterm", "--max-batch-size", "32", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)),
        "fault": Serve(tmp, "fault"),
        "killed": Serve(tmp, "killed", "--no-exit-on-engine-failure"),
    }
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module")
def shared(servers):
    server = servers["shared"].ready()
    httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120,   # the first forward is slow
               json={"model": _model(server.url), "prompt": "warm up", "max_tokens": 2})
    return server


def metrics(url: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", headers=AUTH, timeout=10).text):
        for s in family.samples:
            if not s.labels:
                values[s.name] = s.value
    return values


def chat(content="hi", **fields) -> dict:
    """A chat body for model "tiny" (tests swap in the served id, the tiny model's directory)."""
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def assert_recovers(url: str, headers=AUTH) -> int:
    """A normal request succeeds, and the server is back to idle; returns the request's prompt tokens."""
    r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=WAIT,
                   json={"model": _model(url), "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + WAIT
    while True:
        m = metrics(url)
        idle = (m["lmport_requests_running"], m["lmport_requests_waiting"], m["lmport_kv_blocks_used"],
                m["lmport_requests_admitted"]) == (0, 0, 0, 0)
        if idle:
            return r.json()["usage"]["prompt_tokens"]
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


J = {"Content-Type": "application/json"}

# (case, path, headers, body (dict: JSON; bytes: as is), expected status, param the error names or None)
WHY = [
    ("temperature 1e-300 acts as greedy", "chat", J, chat(temperature=1e-300), 200, None),
    ("top_k 1e23", "chat", J, chat(top_k=10**23), 400, "top_k"),
    ("top_k above the vocabulary", "chat", J, chat(top_k=49153), 400, "top_k"),
    ("repetition_penalty 1e-320", "chat", J, chat(repetition_penalty=1e-320), 400, "repetition_penalty"),
    ("repetition_penalty 1e300", "chat", J, chat(repetition_penalty=1e300), 400, "repetition_penalty"),
    ("[[1]] x 5000 prompts, n 16", "completions", J, {"model": "tiny", "prompt": [[1]] * 5000, "n": 16}, 400,
     "prompt"),
    ("100,000 prompts", "completions", J, {"model": "tiny", "prompt": ["a"] * 100_000}, 400, "prompt"),
    ("1.9 MB prompt", "completions", J, {"model": "tiny", "prompt": "word " * 380_000}, 400, "prompt"),
    ("stop ''", "chat", J, chat(stop=""), 400, "stop"),
    ("17 stop strings", "chat", J, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("100 KB model name", "chat", J, chat(model="m" * 100_000), 404, "model"),
    ("logit_bias id outside the vocabulary", "chat", J, chat(logit_bias={"99999999": 10}), 400, "logit_bias"),
    ("best_of 3", "completions", J, {"model": "tiny", "prompt": "a", "best_of": 3}, 400, "best_of"),
    ("functions", "chat", J, chat(functions=[{"name": "f", "parameters": {}}]), 400, "functions"),
    ("text/plain POST", "chat", {"Content-Type": "text/plain"}, json.dumps(chat()).encode(), 415, None),
    ("form POST", "completions", {"Content-Type": "application/x-www-form-urlencoded"}, b"model=tiny&prompt=a",
     415, None),
    ("foreign Host header (DNS rebinding)", "chat", {**J, "Host": "attacker.example"}, chat(), 421, None),
]


@pytest.mark.parametrize("case, path, headers, body, status, param", WHY, ids=[w[0] for w in WHY])
def test_why_case_gets_a_clear_answer_and_the_server_recovers(shared, case, path, headers, body, status, param):
    if isinstance(body, dict) and body["model"] == "tiny":
        body = {**body, "model": _model(shared.url)}   # the served id is the model's directory
    elif isinstance(body, bytes):
        body = body.replace(b"tiny", _model(shared.url).encode())
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
    prompt_tokens = metrics(shared.url)["lmport_prompt_tokens_total"]
    r = httpx.post(shared.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions"),
                   headers={**AUTH, **headers}, timeout=WAIT, **kwargs)
    assert r.status_code == status, r.text
    if status != 200:
        error = r.json()["error"]
        assert error["param"] == param and len(error["message"]) < 400, error
        if param:
            assert error["message"].startswith(param), error
    sent = r.json()["usage"]["prompt_tokens"] if status == 200 else 0
    normal = assert_recovers(shared.url)
    # Refused before anything was queued: the engine received no prompt but the two answered ones.
    assert metrics(shared.url)["lmport_prompt_tokens_total"] - prompt_tokens == sent + normal


def test_stop_messages_name_the_field_and_the_limit(shared):
    model = _model(shared.url)
    r = httpx.post(shared.url + "/v1/chat/completions", headers=AUTH, json=chat(stop=["a"] * 17, model=model))
    assert r.json()["error"]["message"] == "stop: 17 stop strings; give at most 16"
    r = httpx.post(shared.url + "/v1/chat/completions", headers=AUTH, json=chat(stop=["ok", ""], model=model))
    assert r.json()["error"]["message"].startswith("stop.1: an empty stop string")


def test_docs_need_the_api_key_and_cors_is_off(shared):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(shared.url + path).status_code == 401
        assert httpx.get(shared.url + path, headers=AUTH).status_code == 200
    preflight = httpx.options(shared.url + "/v1/chat/completions", headers={
        "Origin": "https://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    assert httpx.get(shared.url + "/health", headers={"Host": f"localhost:{shared.port}"}).status_code == 200


def test_tokenizing_a_long_prompt_does_not_block_the_event_loop(shared):
    """A prompt just under the character limit is tokenized in a worker thread: /health answers meanwhile (on the
    event loop, the held tokenizing would keep /health waiting until its timeout)."""
    card = httpx.get(shared.url + "/v1/models", headers=AUTH, timeout=WAIT).json()["data"][0]
    limit = 16 * card["max_model_len"]   # --max-prompt-chars' default: 16 x session_len
    body = {"model": card["id"], "prompt": "lorem ipsum dolor " * (limit // 18), "max_tokens": 1}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with shared.hold("tokenize") as tokenizing:
            pending = pool.submit(httpx.post, shared.url + "/v1/completions", headers=AUTH, json=body, timeout=WAIT)
            tokenizing()
            assert httpx.get(shared.url + "/health", timeout=WAIT).status_code == 200
            assert not pending.done()
        assert pending.result().status_code == 400   # over session_len in tokens
    assert_recovers(shared.url)


def test_queue_limit_gives_503_with_retry_after_and_metrics_answer_while_the_engine_steps(shared):
    """20 concurrent requests against max_batch_size 1 + max_waiting_requests 4, while no step can finish one."""
    body = chat(max_tokens=60, ignore_eos=True, model=_model(shared.url))

    def post(_):
        r = httpx.post(shared.url + "/v1/chat/completions", headers=AUTH, json=body, timeout=WAIT)
        return r.status_code, r.headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        with shared.hold("steps") as stepping:
            pending = [pool.submit(post, i) for i in range(20)]
            refused = [f.result() for f in itertools.islice(concurrent.futures.as_completed(pending, WAIT), 15)]
            assert refused == [(503, "1")] * 15
            stepping()
            # /metrics reads what the core published; a step in progress does not hold it up.
            assert metrics(shared.url)["lmport_requests_admitted"] == 5
            assert sum(not f.done() for f in pending) == 5
        assert sorted(f.result()[0] for f in pending) == [200] * 5 + [503] * 15
    assert_recovers(shared.url)


def test_half_sent_headers_are_cut_off_and_slow_bodies_get_408(shared):
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", shared.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        socks.append(s)
    for s in socks:
        s.settimeout(WAIT)
        assert s.recv(100) == b""   # closed by the server (--header-timeout 1), not timed out here
        s.close()
    with socket.create_connection(("127.0.0.1", shared.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\"")
        s.settimeout(WAIT)
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply   # --body-timeout 2
    assert_recovers(shared.url)


def test_an_empty_api_key_is_an_error():
    proc = subprocess.run([sys.executable, "-m", "lmport", "serve", tiny_model_dir("llama"), "--api-key", ""],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "API key is empty" in proc.stderr


def _stream(url: str, results: list, started: threading.Semaphore | None = None, max_tokens=1500):
    """A streamed chat; appends (events, saw_done, error) when it ends."""
    events, done, error = [], False, None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "model": _model(url), "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if started is not None and len(events) == 2:
                        started.release()
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    results.append((events, done, error))


def _ended_properly(events) -> bool:
    last = events[-1]
    return "error" in last or last["choices"][0]["finish_reason"] is not None


def _streams_in_flight(url: str, n: int) -> tuple[list, list[threading.Thread]]:
    """``n`` streams started, each past its first event: (their results, their threads)."""
    results, started = [], threading.Semaphore(0)
    threads = [threading.Thread(target=_stream, args=(url, results, started)) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        assert started.acquire(timeout=60)
    return results, threads


def test_sigterm_ends_every_stream_with_a_final_event_and_exits_0(servers):
    server = servers["sigterm"].ready()
    results, threads = _streams_in_flight(server.url, 20)
    with server.hold("steps"):   # no stream can finish within the shutdown timeout: each is aborted
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(WAIT)
    assert server.proc.wait(timeout=WAIT) == 0, server.log.read_text()
    assert len(results) == 20
    for events, done, error in results:
        assert error is None and done and "error" in events[-1], (error, done, events[-1:])
        assert events[-1]["error"]["code"] == "shutting_down", events[-1]
    with pytest.raises(httpx.ConnectError):   # nothing listens any more
        httpx.get(server.url + "/health", timeout=WAIT)


def test_an_engine_fault_errors_every_stream_and_exits_non_zero(servers):
    server = servers["fault"].ready()
    results, threads = _streams_in_flight(server.url, 5)
    server.files["fault"].write_text("fail")
    for t in threads:
        t.join(WAIT)
    assert len(results) == 5
    for events, done, error in results:
        assert error is None and done and "error" in events[-1], (error, done, events[-1:])
        assert "injected engine fault" in events[-1]["error"]["message"]
    assert server.proc.wait(timeout=WAIT) not in (0, None)
    assert "injected engine fault" in server.log.read_text()


def test_killing_the_engine_core_process_errors_every_stream_and_health_turns_503(servers):
    import psutil
    server = servers["killed"].ready()
    results, threads = _streams_in_flight(server.url, 5)
    front_end = psutil.Process(server.proc.pid)
    (core,) = [p for p in front_end.children() if p.cmdline() == front_end.cmdline()]   # forked from it
    core.kill()
    for t in threads:
        t.join(WAIT)
    assert len(results) == 5
    for events, done, error in results:
        assert error is None and done and "error" in events[-1], (error, done, events[-1:])
        assert "engine core process exited" in events[-1]["error"]["message"], events[-1]
    # Every stream has its error: the client has seen the core's exit, so /health says so too.
    health = httpx.get(server.url + "/health", timeout=WAIT)
    assert health.status_code == 503 and "engine core process exited" in health.json()["reason"], health.text
    r = httpx.post(server.url + "/v1/completions", json={"model": _model(server.url), "prompt": "a"}, timeout=WAIT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped", r.text
    assert server.proc.poll() is None   # --no-exit-on-engine-failure: it stays up to say why
