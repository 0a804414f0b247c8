"""Issue 63, item 1: a big whole answer is serialised in pieces, so the event loop is not held for all of it.

json's C encoder holds the GIL for the whole of one call: a 48 MB answer encoded in one call (even in a worker
thread) held /health for seconds. lmport.server.answers encodes an answer in pieces of about ``PIECE``
characters; the GIL passes to the event loop between them. These tests check that the pieces make exactly the
JSON text Starlette's JSONResponse writes (what the routes wrote before), and that no single call of the encoder
writes much more than a piece, for a real route's answer and for the shape of the big answer the probe sends.
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from lmport.server import answers
from test_server import tool_model_server

number = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0, -0.0, 1e-300, 1e300, 5e-324]))
scalar = st.none() | st.booleans() | number | st.text(max_size=8)
json_value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=6)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=6), max_leaves=60)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few characters, so a small value is sliced and opened as a big answer is."""
    monkeypatch.setattr(answers, "PIECE", 8)


@settings(max_examples=200, deadline=None)
@given(value=json_value)
def test_the_pieces_are_the_json_text_jsonresponse_writes(value):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answers, "PIECE", 8)
        assert answers.joined(value) == JSONResponse(value).body


@pytest.mark.parametrize("value", [
    {1: "a", None: [1, 2], 2.5: {"x": []}},       # keys json converts to strings
    [[{"a": [1] * 40}] * 3],                      # a list of one big item
    ["é日本\n\"\\\u2028"] * 30 + [{"token": "\x00"}],
    [[], {}, [[]], [{}], ""] * 5,
    {"arguments": [[[[[[[[[[[[[[[[[[[[["deep", 1]] * 3]]]]]]]]]]]]]]]]]]] * 4},   # deeper than pieces opens
])
def test_odd_shapes_are_the_json_text_jsonresponse_writes(small_pieces, value):
    assert answers.joined(value) == JSONResponse(value).body


@pytest.mark.parametrize("value", [[1.0, float("nan")], {"a": [0.5] * 20 + [float("inf")]}])
def test_a_value_json_cannot_write_is_refused_as_jsonresponse_refuses_it(small_pieces, value):
    with pytest.raises(ValueError) as whole:
        JSONResponse(value)
    with pytest.raises(ValueError) as sliced:
        answers.joined(value)
    assert str(sliced.value) == str(whole.value)


@pytest.fixture
def encoder_calls(monkeypatch) -> list[int]:
    """The length of the text each call of the C encoder writes."""
    calls: list[int] = []
    encode = answers.encode

    def counted(value):
        text = encode(value)
        calls.append(len(text))
        return text

    monkeypatch.setattr(answers, "encode", counted)
    return calls


def logprob(token: str) -> dict:
    return {"token": token, "logprob": -1.25, "bytes": list(token.encode())}


def test_the_probes_big_answer_is_encoded_a_piece_at_a_time(encoder_calls):
    # 2048 tokens with 20 top logprobs a choice, as in the probe's 45 MiB answer (n=16); its entries are shared objects,
    # which the encoder writes out as often as they appear.
    entry = {**logprob(" the"), "top_logprobs": [logprob(t) for t in ("é", " a", "\n", "日本") * 5]}
    choice = {"index": 0, "message": {"role": "assistant", "content": " the" * 2048},
              "logprobs": {"content": [entry] * 2048}, "finish_reason": "length"}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice] * 4,
            "usage": {"prompt_tokens": 9, "completion_tokens": 4 * 2048, "total_tokens": 9 + 4 * 2048}}
    content = answers.joined(body)
    assert content == JSONResponse(body).body
    assert len(content) > 100 * answers.PIECE
    assert max(encoder_calls) <= 2 * answers.PIECE


def strings(value):
    if isinstance(value, str):
        yield value
    for item in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        yield from strings(item)


@pytest.fixture(scope="module")
def server():
    server = tool_model_server()
    yield server
    server.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
                              "n": 2, "max_tokens": 64}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 5, "echo": True, "n": 2, "max_tokens": 64}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 64}),
])
def test_a_routes_whole_answer_is_encoded_a_piece_at_a_time(server, encoder_calls, monkeypatch, path, body):
    monkeypatch.setattr(answers, "PIECE", 64)
    r = httpx.post(server.url + path, json={"model": "tiny", "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    value = json.loads(r.content)
    assert r.content == JSONResponse(value).body
    assert len(r.content) > 8 * answers.PIECE
    # One string is written by one call, however long (the reply's text).
    longest = max(len(answers.encode(text)) for text in strings(value))
    assert encoder_calls and max(encoder_calls) <= max(2 * answers.PIECE, longest)
