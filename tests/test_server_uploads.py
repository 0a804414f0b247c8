"""Issue 63's items 2, 5 and 8: request bodies bounded in bytes and time on every route, a cap on connections per
client address, aborted uploads logged once without a traceback, and the smaller leaks (adapter paths, echoed
404 paths, cached_tokens over n choices, a taken port found before the model loads).
"""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from lmport.server.connections import ConnectionLimits
from lmport.server.limits import Limits
from support.lora_adapters import adapter_dir
from support.model_helpers import tiny_model_dir
from test_server import ServerThread

BODY_LIMIT = 4096
PER_ADDRESS = 4
PROMPT = " ".join(f"w{i}" for i in range(200))   # several KV blocks


@pytest.fixture(scope="module")
def server():
    engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", dtype="float32", session_len=1024,
                                                          cache_max_entry_count=256, block_size=16,
                                                          enable_prefix_caching=True, max_loras=2, max_lora_rank=8))
    app = create_app(engine, model_name="tiny", max_body_bytes=BODY_LIMIT, limits=Limits(body_timeout=1.0),
                     enable_lora_loading=True)
    # A small global limit: before the per-address cap, a handful of slow connections made /health answer 503.
    srv = ServerThread(app, **ConnectionLimits(max_connections=8, max_connections_per_address=PER_ADDRESS)
                       .uvicorn_kwargs())
    srv.port = int(srv.url.rpartition(":")[2])
    yield srv
    srv.stop()


def _head(port: int, path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{extra}"
            f"\r\n").encode()


def _reply(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response on ``sock`` (read until the server closes it)."""
    sock.settimeout(60)   # a hang guard only
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    return int(head.split()[1]), json.loads(body) if body else {}


def _drained(srv) -> None:
    """Waits (a hang guard, not a measurement) until the server holds no connection and runs no request."""
    state = srv.server.server_state
    deadline = time.monotonic() + 60
    while (state.connections or state.tasks) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(srv) -> None:
    """Waits (a hang guard) until the server runs a request."""
    deadline = time.monotonic() + 60
    while not srv.server.server_state.tasks and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/chat/completions", "/v1/load_lora_adapter"])
def test_a_chunked_body_over_the_limit_is_refused_before_it_is_read(server, path):
    total = 64 * 2**20
    sent = 0
    sock = socket.create_connection(("127.0.0.1", server.port))

    def upload():
        nonlocal sent
        chunk = b"%x\r\n%s\r\n" % (2**16, b" " * 2**16)
        try:
            sock.sendall(_head(server.port, path, "Transfer-Encoding: chunked\r\n"))
            while sent < total:
                sock.sendall(chunk)
                sent += 2**16
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass   # the server answered and closed the connection: it reads no more

    sender = threading.Thread(target=upload)
    sender.start()
    status, body = _reply(sock)
    sender.join()
    sock.close()
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert str(BODY_LIMIT) in body["error"]["message"]
    # What the client got into the server before the answer: the limit plus the sockets' buffers, not the body.
    assert sent < total // 4, sent


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/messages",
                                  "/v1/responses", "/v1/load_lora_adapter"])
def test_a_body_whose_length_is_over_the_limit_gets_413_and_the_connection_serves_on(server, path):
    """An ordinary client sends the whole body it declared before it reads: it gets the 413, not a reset, and its
    connection (kept alive) serves its next request."""
    body = json.dumps({"model": "tiny", "input": "x" * (32 << 20)})   # past the sockets buffers
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        assert str(BODY_LIMIT) in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/load_lora_adapter", "/v1/messages"])
def test_a_slow_body_gets_408(server, path):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_head(server.port, path, "Content-Length: 100\r\n") + b'{"model"')
        status, body = _reply(sock)
    assert status == 408, body
    error = body["error"]
    assert error.get("code", "body_timeout") == "body_timeout"   # Anthropic's shape has no code
    assert "did not arrive within 1 s" in error["message"]


def test_slow_connections_from_one_address_leave_health_and_streams_answering(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "go", "max_tokens": 64, "ignore_eos": True, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")   # admitted and streaming
        slow = []
        for _ in range(20):   # each sends half its headers and then nothing
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            slow.append(sock)
        try:
            health = httpx.get(server.url + "/health", timeout=60)
            assert health.status_code == 200, health.text
            assert "data: [DONE]" in list(lines)   # the admitted stream ran to its end
        finally:
            for sock in slow:
                sock.close()
        assert stream.status_code == 200
    _drained(server)


def test_aborted_uploads_are_logged_once_without_tracebacks(server, caplog):
    uvicorn_log = logging.getLogger("uvicorn")   # uvicorn's loggers do not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    try:
        _drained(server)
        caplog.clear()
        for i in range(20):
            path = "/v1/embeddings" if i % 2 else "/v1/chat/completions"
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(_head(server.port, path, "Content-Length: 3000\r\n") + b'{"model": "tiny", ' + b" " * 999)
                _running(server)   # the request is in the app, reading its body, when the client leaves
            _drained(server)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    # The access log's line a request is its own (lmport.server.access_log); the disconnects' are counted here.
    records = [r for r in caplog.records if r.levelno >= logging.INFO and r.name != "lmport.access"]
    text = "\n".join(caplog.handler.format(r) for r in records)
    assert not any(r.exc_info for r in records) and "Traceback" not in text, text[:2000]
    assert all(r.levelno == logging.INFO for r in records), text[:2000]
    assert "closed the connection" in text
    assert len(text) < 2000, text   # twenty full tracebacks were 158 KB


# -- item 8 -------------------------------------------------------------------------------------------------------
def _load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def test_adapter_errors_and_model_cards_do_not_show_server_paths(server, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes(b"\xffsecret-bytes")
    replies = [_load(server, "x", path) for path in ("/etc", "/no/such/dir", str(tmp_path), str(bad))]
    messages = {r.json()["error"]["message"] for r in replies}
    assert [r.status_code for r in replies] == [400] * 4, [r.text for r in replies]
    assert {(r.json()["error"]["param"], r.json()["error"]["code"]) for r in replies} == \
        {("lora_path", "lora_adapter_invalid")}
    assert len(messages) == 1 and "could not be loaded" in next(iter(messages)), messages   # one answer: no probing
    for r in replies:
        assert "/" not in r.json()["error"]["message"] and "secret" not in r.text
    # the server's log
    assert "is not a directory" in caplog.text and "has no adapter_config.json" in caplog.text, caplog.text[-2000:]

    path = adapter_dir(tiny_model_dir("llama"), 8, seed=1)
    loaded = _load(server, "hot", path)
    assert loaded.status_code == 200, loaded.text
    try:
        for reply in (loaded, httpx.get(server.url + "/v1/models"), httpx.get(server.url + "/v1/models/hot")):
            assert reply.status_code == 200 and path not in reply.text and "hot" in reply.text
        server.server.config.app.state.frontend.expose_adapter_paths = True   # --expose-adapter-paths
        assert path in httpx.get(server.url + "/v1/models").text
        assert "is not a directory" in _load(server, "x", "/no/such/dir").json()["error"]["message"]
    finally:
        server.server.config.app.state.frontend.expose_adapter_paths = False
        httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "hot"}, timeout=60)


def test_a_404_echoes_a_short_path(server):
    r = httpx.get(server.url + "/v1/" + "a" * 60000, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert len(r.json()["error"]["message"]) < 300


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_count_each_prompt_once(server, stream):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "n": 4, "temperature": 1.0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    for _ in range(2):   # the second finds the prompt cached, once for each of its four choices
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usage = json.loads(r.text.split("data: ")[-2])["usage"] if stream else r.json()["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage


def test_serve_finds_a_taken_port_before_loading_the_model(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        # No model at this path: loading it would fail, so the answer shows what was tried first.
        proc = subprocess.run([sys.executable, "-m", "lmport", "serve", str(tmp_path / "no-model"),
                               "--port", str(port)], capture_output=True, text=True, timeout=300)
    finally:
        taken.close()
    from lmport.server.listen import ADDRESS_IN_USE_EXIT_CODE
    assert proc.returncode == ADDRESS_IN_USE_EXIT_CODE == 4, proc.stderr
    assert f"127.0.0.1:{port} is already in use" in proc.stderr, proc.stderr
