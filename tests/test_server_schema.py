"""Every answer the server sends is what its OpenAPI document says, field for field.

The routes build their answers as plain dicts typed by the answers' shapes (lmport.server.shapes, TypedDicts
the type checker holds the builders to), and the document's response schemas are made from the same shapes
(lmport.server.openapi). Here every route's answers, whole and streamed (each event), with reasoning, tool calls,
logprobs, usage and errors, are validated against those shapes through pydantic's TypeAdapter with no undeclared
field allowed, so what the type checker cannot see (a value of the wrong kind at run time, a key added through an
untyped dict) fails here too.
"""
from __future__ import annotations

import functools
import json

import httpx
import pydantic
import pytest
from support.chat_families import FamilyServers, reply_ids, scripted

from lmport.server import shapes

KEY = "sk-schema-test"
HI = [{"role": "user", "content": "Hi"}]
REASONED = "<think>\nThe user greets me.\n</think>\n\nHello there."
CALL = ('<think>\nA tool.\n</think>\n\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def qwen3():
    made = FamilyServers()
    thread, engine = made("qwen3", api_key=KEY)
    yield thread, engine
    made.close()


@functools.cache
def adapter(shape) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(shape)


def strict(shape, data: dict) -> None:
    """``data`` validated against ``shape``, whose every nested shape is closed to undeclared fields."""
    try:
        adapter(shape).validate_python(data)
    except pydantic.ValidationError as exc:
        name = adapter(shape).json_schema()["title"]
        raise AssertionError(f"{name} does not describe the answer: {exc}\n{json.dumps(data)[:2000]}") from None


def test_a_key_the_shape_does_not_declare_is_refused():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny", "usage": usage,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop",
                           "logprobs": None}]}
    strict(shapes.ChatCompletion, answer)
    for extra in ({**answer, "extra": 1}, {**answer, "usage": {**usage, "extra": 1}},
                  {**answer, "choices": [{**answer["choices"][0], "extra": 1}]}):
        with pytest.raises(AssertionError, match="ChatCompletion does not describe the answer"):
            strict(shapes.ChatCompletion, extra)
    event = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}
    strict(shapes.AnthropicStreamEvent, event)
    with pytest.raises(AssertionError, match="AnthropicStreamEvent does not describe"):
        strict(shapes.AnthropicStreamEvent, {**event, "delta": {**event["delta"], "extra": 1}})


def post(thread, path: str, body: dict) -> httpx.Response:
    return httpx.post(thread.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def events(thread, path: str, body: dict) -> list[tuple[str | None, dict]]:
    """(event name or None, data) of a streamed answer, up to [DONE]."""
    out, name = [], None
    with httpx.stream("POST", thread.url + path, json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: ") and line != "data: [DONE]":
                out.append((name, json.loads(line[len("data: "):])))
    assert out
    return out


@pytest.mark.parametrize("reply", [REASONED, CALL], ids=["reasoning", "tool-call"])
def test_openai_answers_are_the_documented_shapes(qwen3, reply):
    thread, engine = qwen3
    chat = {"model": "tiny", "messages": HI, "max_tokens": 64, "tools": [TOOL], "logprobs": True,
            "top_logprobs": 2, "n": 2}
    completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 8, "logprobs": 2, "echo": True}
    with scripted(engine, reply_ids(engine, reply)):
        r = post(thread, "/v1/chat/completions", chat)
        assert r.status_code == 200, r.text
        strict(shapes.ChatCompletion, r.json())
        for _, chunk in events(thread, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}):
            strict(shapes.ChatCompletionChunk, chunk)
        r = post(thread, "/v1/completions", completion)
        assert r.status_code == 200, r.text
        strict(shapes.Completion, r.json())
        for _, chunk in events(thread, "/v1/completions", {**completion, "echo": False,
                                                           "stream_options": {"include_usage": True}}):
            strict(shapes.CompletionChunk, chunk)


@pytest.mark.parametrize("reply", [REASONED, CALL], ids=["reasoning", "tool-call"])
def test_anthropic_answers_are_the_documented_shapes(qwen3, reply):
    thread, engine = qwen3
    body = {"model": "tiny", "messages": HI, "max_tokens": 64, "tools": [ANTHROPIC_TOOL]}
    with scripted(engine, reply_ids(engine, reply)):
        r = post(thread, "/v1/messages", body)
        assert r.status_code == 200, r.text
        strict(shapes.AnthropicMessage, r.json())
        for name, event in events(thread, "/v1/messages", body):
            assert name == event["type"]
            strict(shapes.AnthropicStreamEvent, event)
    r = post(thread, "/v1/messages/count_tokens", {"model": "tiny", "messages": HI})
    strict(shapes.MessageTokensCount, r.json())


@pytest.mark.parametrize("reply", [REASONED, CALL], ids=["reasoning", "tool-call"])
def test_responses_answers_are_the_documented_shapes(qwen3, reply):
    thread, engine = qwen3
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 64, "tools": [RESPONSES_TOOL]}
    with scripted(engine, reply_ids(engine, reply)):
        r = post(thread, "/v1/responses", body)
        assert r.status_code == 200, r.text
        strict(shapes.ResponseObject, r.json())
        for name, event in events(thread, "/v1/responses", body):
            assert name == event["type"]
            strict(shapes.ResponseStreamEvent, event)
    r = post(thread, "/v1/responses/input_tokens", {"model": "tiny", "input": "Hi"})
    strict(shapes.InputTokensCount, r.json())


def test_the_other_routes_and_errors_are_the_documented_shapes(qwen3):
    thread, _ = qwen3
    auth = {"Authorization": f"Bearer {KEY}"}
    strict(shapes.ModelList, httpx.get(thread.url + "/v1/models", headers=auth).json())
    strict(shapes.ModelCard, httpx.get(thread.url + "/v1/models/tiny", headers=auth).json())
    strict(shapes.Health, httpx.get(thread.url + "/health").json())
    tokens = post(thread, "/tokenize", {"model": "tiny", "prompt": "Hi there", "return_token_strs": True}).json()
    strict(shapes.TokenizeResponse, tokens)
    detokenized = post(thread, "/detokenize", {"model": "tiny", "tokens": tokens["tokens"]}).json()
    strict(shapes.DetokenizeResponse, detokenized)
    for path, body in (("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": -1}),
                       ("/v1/completions", {"model": "tiny", "prompt": "Hi", "top_k": 10**9}),
                       ("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": -1})):
        r = post(thread, path, body)
        assert r.status_code == 400
        strict(shapes.ErrorResponse, r.json())
    r = post(thread, "/v1/messages", {"model": "tiny", "messages": HI, "max_tokens": -1})
    assert r.status_code == 400
    strict(shapes.AnthropicError, r.json())
