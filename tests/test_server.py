"""The OpenAI-compatible server, driven over loopback HTTP with the official `openai` package.

Two servers run in threads of this process for the whole module: the default
model (where the text matters; it also requires an API key) and a tiny
random-weight model (bad input, disconnects, metrics). One `lmport serve`
subprocess checks the command itself; it starts first so its start-up
overlaps the other tests.
"""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from support.cli_helpers import lmport_command
from support.model_helpers import tiny_model_dir, tiny_tool_model_dir
from support.serve_process import ServeProcess

from lmport.config import EngineConfig
from lmport.engine.core import EngineCore
from lmport.engine.engine import Engine
from lmport.server.app import create_app

API_KEY = "sk-lmport-test"
TINY_BODY_LIMIT = 256 * 1024


class ServerThread:
    """A real uvicorn server on a free loopback port, in a thread of this process."""

    def __init__(self, app, send_buffer: int | None = None, **config):
        """``send_buffer``: the kernel send buffer of its connections (inherited from the listening socket);
        ``config``: more uvicorn.Config settings (``ConnectionLimits.uvicorn_kwargs()``)."""
        sock = socket.socket()
        if send_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one, and nobody can take it before us
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                                    **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=15)


def tool_model_server(**app_options) -> ServerThread:
    """The tiny model whose chat template teaches tools (support.model_helpers.tiny_tool_model_dir), served as
    "tiny" with a 1024-token context; ``app_options``: more create_app arguments (api_key, ...)."""
    engine = Engine(tiny_tool_model_dir(), EngineConfig(cache_max_entry_count=256, session_len=1024))
    return ServerThread(create_app(engine, model_name="tiny", **app_options))


@pytest.fixture(scope="module")
def smol():
    server = ServerThread(create_app(Engine("smollm2", EngineConfig(cache_max_entry_count=512)),
                                     model_name="smollm2", api_key=API_KEY))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny():
    engine = EngineCore(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=512))
    server = ServerThread(create_app(engine, model_name="tiny", max_body_bytes=TINY_BODY_LIMIT))
    server.engine = engine
    yield server
    server.stop()


@contextlib.contextmanager
def steps_held(engine: EngineCore, after: int = 0):
    """The engine's steps after the next ``after`` wait until the block ends, so that no request can finish
    meanwhile; yields an Event set once a step waits."""
    waiting, released, step = threading.Event(), threading.Event(), engine.step
    left = [after]

    def held():
        if left[0] > 0:
            left[0] -= 1
        else:
            waiting.set()
            released.wait(120)   # a hang guard only
        return step()

    engine.step = held   # the engine core calls engine.step() anew each step
    try:
        yield waiting
    finally:
        del engine.step   # the class's step again
        released.set()


@pytest.fixture(scope="module", autouse=True)
def serve_command(tmp_path_factory):
    """`lmport serve` in a subprocess, with the API key from LMPORT_API_KEY."""
    server = ServeProcess(lmport_command(), [tiny_model_dir("llama"), "--host", "127.0.0.1",
                                             "--cache-max-entry-count", "64"],
                          tmp_path_factory.mktemp("serve") / "serve.log", env={"LMPORT_API_KEY": "from-env"})
    yield server
    server.proc.terminate()
    server.proc.wait(timeout=30)


def client(server, api_key=API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    """/metrics as {name or name{labels}: value}."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def wait_idle(server, timeout=20.0) -> dict[str, float]:
    """/metrics once no request runs or waits, or the last reading at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = m["lmport_requests_running"] == 0 and m["lmport_requests_waiting"] == 0
        if idle and m["lmport_kv_blocks_used"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# -- the default model, through the openai client ---------------------------------------------------

def test_models_lists_the_served_model(smol):
    models = client(smol).models.list().data
    assert [m.id for m in models] == ["smollm2"]


def test_api_key_is_required_except_for_health(smol):
    with pytest.raises(openai.AuthenticationError) as exc:
        client(smol, api_key="wrong").chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert exc.value.status_code == 401
    assert exc.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(smol.url + path)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(smol.url + "/health").status_code == 200
    assert httpx.get(smol.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_chat_completion(smol):
    r = client(smol).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France? Answer in one "
                                                              "sentence."}],
        max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert r.model == "smollm2" and r.object == "chat.completion"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_equals_the_non_streamed_text_under_greedy(smol):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Write a short poem about the sea."}],
                  max_tokens=24, temperature=0)
    whole = client(smol).chat.completions.create(**kwargs)
    chunks = list(client(smol).chat.completions.create(**kwargs, stream=True,
                                                       stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == whole.choices[0].message.content
    assert len([d for d in deltas if d]) > 10  # it really streamed, token by token
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completion_with_a_stop_string(smol):
    kwargs = dict(model="smollm2", prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0, stop=[" 8"])
    r = client(smol).completions.create(**kwargs)
    assert r.choices[0].text == " 6, 7,"
    assert r.choices[0].finish_reason == "stop"
    # Streamed, the " " before "8" (a token of its own) must not be sent before the stop string is known.
    chunks = list(client(smol).completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " 6, 7,"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_lmport_chat_url_client(smol):
    from lmport.entrypoints.chat import _remote_stream
    from lmport.config import GenerationConfig
    stream = _remote_stream(smol.url, API_KEY, GenerationConfig(max_new_tokens=40))
    text = "".join(stream([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]))
    assert "Paris" in text


# -- the tiny model -------------------------------------------------------------------------------------

def test_n_seed_and_logprobs(tiny):
    c = client(tiny)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3, seed=7,
                  temperature=1.0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    first, again = c.chat.completions.create(**kwargs), c.chat.completions.create(**kwargs)
    texts = [ch.message.content for ch in first.choices]
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in again.choices]  # a seed repeats
    assert len(set(texts)) > 1                                     # ...but the n choices differ
    lp = first.choices[0].logprobs.content
    assert len(lp) == 6 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    assert first.usage.completion_tokens == 18

    r = c.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0, logprobs=1,
                             extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and all(len(ch.logprobs.tokens) == 4 for ch in r.choices)
    assert all("".join(ch.logprobs.tokens) == ch.text for ch in r.choices)


def _chat_body(content="hi", **fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


LONG_PROMPT = "hello " * 2500  # over the tiny model's 2048-token session length

# (case, path, body: dict is sent as JSON, str/bytes as is, status, the field the message names or None)
BAD_INPUT = [
    ("malformed JSON", "chat", '{"model": "tiny", "messages": [', 400, None),
    ("body is not a JSON object", "chat", "[1, 2]", 400, None),
    ("max_tokens is a string", "chat", _chat_body(max_tokens="ten"), 400, "max_tokens"),
    ("messages is a string", "chat", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("temperature is a string", "chat", _chat_body(temperature="hot"), 400, "temperature"),
    ("message content is a number", "chat", _chat_body(content=5), 400, "messages.0.content"),
    ("unknown role", "chat", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("stop is a number", "completions", {"model": "tiny", "prompt": "a", "stop": 5}, 400, "stop"),
    ("missing model", "chat", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ("unknown model", "chat", _chat_body(model="gpt-4"), 404, "model"),
    ("max_tokens = 0", "chat", _chat_body(max_tokens=0), 400, "max_tokens"),
    ("max_tokens < 0", "completions", {"model": "tiny", "prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("temperature < 0", "chat", _chat_body(temperature=-1), 400, "temperature"),
    ("top_p = 0", "chat", _chat_body(top_p=0), 400, "top_p"),
    ("n = 0", "chat", _chat_body(n=0), 400, "n"),
    ("empty messages list", "chat", {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat prompt over session_len", "chat", _chat_body(content=LONG_PROMPT), 400, "messages"),
    ("prompt over session_len", "completions", {"model": "tiny", "prompt": LONG_PROMPT}, 400, "prompt"),
    ("empty prompt", "completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("token id out of vocab", "completions", {"model": "tiny", "prompt": [1, 10**9]}, 400, "prompt"),
    ("body over the size limit", "chat", _chat_body(content="x" * (TINY_BODY_LIMIT + 1)), 413, None),
    ("chunked body over the limit", "chat",
     iter([b'{"model": "tiny", "messages": [{"role": "user", "content": "', b"x" * (TINY_BODY_LIMIT + 1), b'"}]}']),
     413, None),
]


def test_bad_input_gets_a_4xx_naming_the_field_while_a_normal_request_completes(tiny):
    normal = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=64,
                  temperature=0, extra_body={"ignore_eos": True})
    expected = client(tiny).chat.completions.create(**normal).choices[0].message.content
    with steps_held(tiny.engine, after=1):   # one step (its first token), then it waits: still running after
        streamed, worker = _bad_input_during_a_stream(tiny, normal)
        assert streamed[-1] is not None   # still running
    worker.join(120)
    assert streamed[-1] is None and "".join(streamed[:-1]) == expected
    m = wait_idle(tiny)
    assert m["lmport_requests_running"] == 0 and m["lmport_kv_blocks_used"] == 0


def _bad_input_during_a_stream(tiny, normal: dict) -> tuple[list, threading.Thread]:
    """Starts a stream of ``normal``, sends every BAD_INPUT case once it has a token; (its deltas, its thread)."""
    streamed, first_token = [], threading.Event()

    def run_normal():
        try:
            for chunk in client(tiny).chat.completions.create(**normal, stream=True):
                if chunk.choices:
                    streamed.append(chunk.choices[0].delta.content or "")
                    first_token.set()
        finally:
            streamed.append(None)  # the end

    worker = threading.Thread(target=run_normal)
    worker.start()
    assert first_token.wait(60)
    table = []
    with httpx.Client(base_url=tiny.url + "/v1", timeout=60) as http:
        for case, path, body, status, param in BAD_INPUT:
            kwargs = {"json": body} if isinstance(body, dict) else {
                "content": body, "headers": {"Content-Type": "application/json"}}
            r = http.post("/chat/completions" if path == "chat" else "/completions", **kwargs)
            error = r.json()["error"]
            table.append((case, r.status_code, error["param"], error["message"][:90]))
            assert r.status_code == status, (case, r.text)
            assert error["param"] == param, (case, error)
            assert param is None or error["message"].startswith(param.split(".")[0]), (case, error)
            assert error["type"] and error["message"]
        assert http.get("/nope").status_code == 404
        assert http.get("/chat/completions").status_code == 405
    print("\n".join(f"{status}  {case:32}  param={param!s:20} {message}" for case, status, param, message in table))
    return streamed, worker


def test_bodies_a_little_over_the_limit_get_413_every_time(tiny):
    """Bodies over the limit while their client is still sending, declared and streamed (chunked), one after the
    other on a connection: each gets its 413, never lost to a reset connection (closing a connection with unread
    bytes in it resets it), and the connection serves on."""
    streamed = [b'{"model": "tiny", "prompt": "', b"x" * TINY_BODY_LIMIT, b'"}']
    for _ in range(50):   # an answer that closed the connection at once lost about one in ten
        with httpx.Client(base_url=tiny.url + "/v1", timeout=60) as http:
            replies = [http.post("/completions", json={"model": "tiny", "prompt": "x" * (TINY_BODY_LIMIT + 1)}),
                       http.post("/completions", content=iter(streamed), headers={"Content-Type": "application/json"})]
            for r in replies:
                assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
            assert http.get("/models").status_code == 200


def _abort_count(m) -> float:
    return m.get("lmport_requests_finished_total{finish_reason=abort}", 0.0)


def test_clients_that_disconnect_mid_stream_free_their_blocks(tiny):
    before = metrics(tiny)
    body = _chat_body("Tell me a long story.", max_tokens=1500, stream=True, ignore_eos=True, temperature=0)
    received = []

    def client_that_leaves():
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", tiny.url + "/v1/chat/completions", json=body) as r:
                chunks = 0
                for line in r.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["finish_reason"] is None:
                        chunks += 1
                        if chunks == 3:
                            break
                received.append(chunks)
        # Leaving the blocks with the response unread closes the connection: the client is gone.

    threads = [threading.Thread(target=client_that_leaves) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert received == [3] * 20
    after = wait_idle(tiny)
    assert after["lmport_requests_running"] == 0 and after["lmport_requests_waiting"] == 0
    assert after["lmport_kv_blocks_used"] == 0 and after["lmport_kv_blocks_total"] == 512
    # Each of the 20 ended as aborted, not finished: far fewer tokens than 20 x 1500 were generated.
    assert _abort_count(after) - _abort_count(before) == 20
    assert after["lmport_generation_tokens_total"] - before["lmport_generation_tokens_total"] < 20 * 1500 / 2


def test_a_non_streaming_client_that_gives_up_aborts_its_request(tiny):
    before = metrics(tiny)
    body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2000, "ignore_eos": True}).encode()
    host, port = tiny.url.removeprefix("http://").split(":")
    with steps_held(tiny.engine, after=1) as running:   # the request cannot finish before its client leaves
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert running.wait(60)
        # The client is gone: its request leaves the server's admission (then the engine), unanswered.
        deadline = time.monotonic() + 60
        while metrics(tiny)["lmport_requests_admitted"] != 0:
            assert time.monotonic() < deadline, "the server did not notice the client leave"
            time.sleep(0.05)
    after = wait_idle(tiny)
    assert after["lmport_requests_running"] == 0 and after["lmport_kv_blocks_used"] == 0
    assert _abort_count(after) - _abort_count(before) == 1


def test_metrics_exposes_engine_state_and_latency_histograms(tiny):
    client(tiny).completions.create(model="tiny", prompt="a", max_tokens=5, extra_body={"ignore_eos": True})
    m = metrics(tiny)
    for name in ("lmport_requests_running", "lmport_requests_waiting", "lmport_kv_blocks_used",
                 "lmport_kv_blocks_total", "lmport_generation_tokens_total", "lmport_prefix_cache_hit_rate"):
        assert name in m, name
    assert m["lmport_time_to_first_token_seconds_count"] >= 1
    assert m["lmport_inter_token_latency_seconds_count"] >= 4
    assert httpx.get(tiny.url + "/health").json() == {"status": "ok"}


# -- the command ------------------------------------------------------------------------------------------

def test_lmport_serve_command(serve_command):
    url = serve_command.ready().url   # --port 0: the address from the line `lmport serve` prints
    assert httpx.get(url + "/v1/models").status_code == 401  # LMPORT_API_KEY is enforced
    c = openai.OpenAI(base_url=url + "/v1", api_key="from-env", max_retries=0)
    model = c.models.list().data[0].id
    r = c.completions.create(model=model, prompt="a", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
