"""Issue 63 ("What a hostile probe found"), items 1, 4 and 6: a big whole answer is built off the event loop and
bounded in size, every integer field is bounded the same way on every route (and a stream that fails after its
200 still ends properly), and no body may nest JSON deeper than the server's limit. One server over the tiny
random-weight Qwen2 model (a chat template, so every route answers) runs in a thread of this process.
"""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server import openai_mapping
from lmport.server.app import create_app
from lmport.server.limits import Limits
from support.model_helpers import tiny_tool_model_dir
from test_server import ServerThread

ANSWER_LIMIT = 20_000   # token entries in a whole answer: small, so the tiny model can ask for more


@pytest.fixture(scope="module")
def server():
    engine = Engine(tiny_tool_model_dir(), EngineConfig(cache_max_entry_count=128, session_len=512))
    app = create_app(engine, model_name="tiny", limits=Limits(max_answer_entries=ANSWER_LIMIT))
    server = ServerThread(app)
    server.frontend = app.state.frontend
    yield server
    server.stop()


def post(server, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"},
                          timeout=timeout)
    return httpx.post(server.url + path, json=body, timeout=timeout)


def chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def completion(**kw) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **kw}


def anthropic_messages(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def responses(**kw) -> dict:
    return {"model": "tiny", "input": "hi", "max_output_tokens": 4, **kw}


def error(r: httpx.Response) -> dict:
    """The error of an OpenAI-shaped or an Anthropic-shaped answer."""
    return r.json()["error"]


# -- 1. a whole answer is built and serialised off the event loop, and bounded in size --------------------------

def test_health_answers_while_a_big_answer_is_built(server, monkeypatch):
    building, release = threading.Event(), threading.Event()
    build = openai_mapping.ChatReply.body

    def slow_body(self, outs):   # stands for building and serialising a 48 MB answer
        building.set()
        release.wait(60)          # the hang guard: built on the event loop, this holds the whole server
        return build(self, outs)

    monkeypatch.setattr(openai_mapping.ChatReply, "body", slow_body)
    answer: dict = {}
    client = threading.Thread(target=lambda: answer.update(r=post(server, "/v1/chat/completions", chat(n=2))))
    client.start()
    try:
        assert building.wait(60), "the answer was never built"
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200
    finally:
        release.set()
        client.join(60)
    r = answer["r"]
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_a_big_answer_comes_back_whole_and_as_json(server):
    r = post(server, "/v1/chat/completions", chat(n=4, max_tokens=32, ignore_eos=True, logprobs=True,
                                                  top_logprobs=20))
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    choices = r.json()["choices"]
    assert [len(c["logprobs"]["content"]) for c in choices] == [32] * 4
    assert all(len(e["top_logprobs"]) == 20 for c in choices for e in c["logprobs"]["content"])


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat(n=16, max_tokens=100, logprobs=True, top_logprobs=20)),
    ("/v1/completions", completion(n=16, max_tokens=100, logprobs=20)),
])
def test_an_answer_too_big_to_send_whole_is_refused_before_generating(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = error(r)
    assert err["param"] == "max_tokens" and err["code"] == "answer_too_large"
    assert f"limit of {ANSWER_LIMIT}" in err["message"] and "--max-answer-entries" in err["message"]
    assert "stream=true" in err["message"]
    assert server.frontend.admission.active == 0
    # Streamed, the same request is fine: each piece is small.
    with httpx.stream("POST", server.url + path, json={**body, "max_tokens": 4, "stream": True}, timeout=60) as s:
        assert s.status_code == 200 and s.read().decode().rstrip().endswith("data: [DONE]")


# -- 4. integer fields are bounded the same on every route ----------------------------------------------------

HUGE = 2**64

BOUNDED = [
    ("/v1/chat/completions", chat(max_tokens=HUGE), "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens=HUGE), "max_completion_tokens"),
    ("/v1/chat/completions", chat(seed=HUGE), "seed"),
    ("/v1/chat/completions", chat(n=HUGE), "n"),
    ("/v1/chat/completions", chat(top_k=HUGE), "top_k"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=HUGE), "top_logprobs"),
    ("/v1/chat/completions", chat(best_of=HUGE), "best_of"),
    ("/v1/completions", completion(max_tokens=HUGE), "max_tokens"),
    ("/v1/completions", completion(max_tokens=2**31), "max_tokens"),
    ("/v1/completions", completion(seed=-HUGE), "seed"),
    ("/v1/completions", completion(logprobs=HUGE), "logprobs"),
    ("/v1/messages", anthropic_messages(max_tokens=HUGE), "max_tokens"),
    ("/v1/messages", anthropic_messages(top_k=HUGE), "top_k"),
    ("/v1/responses", responses(max_output_tokens=HUGE), "max_output_tokens"),
    ("/v1/responses", responses(top_logprobs=HUGE), "top_logprobs"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body, field", BOUNDED, ids=[f"{p}-{f}" for p, _, f in BOUNDED])
def test_an_integer_out_of_bounds_is_a_400_naming_the_field(server, path, body, field, stream):
    r = post(server, path, {**body, "stream": stream})
    assert r.status_code == 400, r.text
    err = error(r)
    if path.startswith("/v1/messages"):   # Anthropic's shape: no param, the message starts with the field
        assert err["type"] == "invalid_request_error"
    else:
        assert err["param"] == field
    assert err["message"].startswith(f"{field}: ")
    assert "out of range" in err["message"] and "give a value" in err["message"]
    assert "Input should" not in err["message"]   # lmport's words, not pydantic's


def test_the_largest_max_tokens_is_accepted(server):
    r = post(server, "/v1/chat/completions", chat(max_tokens=2**31 - 1, seed=2**64 - 1))
    assert r.status_code == 200, r.text


def test_a_token_id_out_of_bounds_is_a_400(server):
    r = post(server, "/v1/completions", completion(prompt=[1, HUGE]))
    assert r.status_code == 400 and error(r)["param"] == "prompt", r.text


def _broken_engine(monkeypatch, server):
    """The engine fails every request after the route has answered 200 (as packing a huge int once did)."""
    async def generate(request):
        raise OverflowError("int too big to convert")
        yield  # an async generator, as the real one

    monkeypatch.setattr(server.frontend.core, "generate", generate)


def _stream_text(server, path: str, body: dict) -> str:
    text = ""
    try:
        with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as s:
            assert s.status_code == 200
            for piece in s.iter_text():
                text += piece
    except httpx.TransportError as exc:   # the connection cut with no error event
        pytest.fail(f"the stream was cut ({type(exc).__name__}) after: {text[-300:]!r}")
    return text


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", chat()), ("/v1/completions", completion())])
def test_an_openai_stream_that_fails_after_its_200_ends_with_an_error_and_done(server, monkeypatch, path, body):
    _broken_engine(monkeypatch, server)
    events = [e for e in _stream_text(server, path, body).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["type"] == "server_error" and "OverflowError" in err["message"]


def test_an_anthropic_stream_that_fails_after_its_200_ends_with_its_error_event(server, monkeypatch):
    _broken_engine(monkeypatch, server)
    last = [e for e in _stream_text(server, "/v1/messages", anthropic_messages()).split("\n\n") if e][-1]
    name, data = last.split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: "))["error"]["type"] == "api_error"


def test_a_responses_stream_that_fails_after_its_200_ends_with_response_failed(server, monkeypatch):
    _broken_engine(monkeypatch, server)
    events = [e for e in _stream_text(server, "/v1/responses", responses()).split("\n\n") if e]
    assert events[-2].startswith("event: error\n") and events[-1].startswith("event: response.failed\n")


# -- 6. JSON nested deeper than the limit -----------------------------------------------------------------------

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"]


@pytest.mark.parametrize("path", ROUTES)
def test_deep_json_is_a_400_naming_the_limit(server, path):
    deep = b'{"model": "tiny", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    r = post(server, path, deep)
    assert r.status_code == 400, r.text
    err = error(r)
    assert "nests JSON 1001 levels deep" in err["message"] and "at most 64" in err["message"]
    if not path.startswith("/v1/messages"):
        assert err["code"] == "json_too_deep"


@pytest.mark.parametrize("path", ROUTES)
def test_json_at_the_depth_limit_is_parsed(server, path):
    # 64 levels in all, brackets inside strings not counted: the body gets past parsing (to its own answer).
    body = b'{"model": "tiny", "x": "[[[[{{{{", "nested": ' + b"[" * 63 + b"]" * 63 + b"}"
    r = post(server, path, body)
    assert r.status_code != 500 and "levels deep" not in r.text, r.text
