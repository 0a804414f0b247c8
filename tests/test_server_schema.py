"""Every answer the server sends is what its OpenAPI document says, field for field.

The routes build their answers as plain dicts (serialised off the event loop by json's C encoder); the document's
response models (lmport.server.openapi) are the one declaration of their shapes. Here every route's answers, whole
and streamed (each event), with reasoning, tool calls, logprobs, usage and errors, are validated against those
models with no undeclared field allowed, so a field a route adds without declaring it fails here.
"""
from __future__ import annotations

import json

import httpx
import pydantic
import pytest
from support.chat_families import FamilyServers, reply_ids, scripted

from lmport.server import openapi

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


def strict(model: type[pydantic.BaseModel], data: dict) -> None:
    """``data`` validated against ``model`` with every nested model closed to undeclared fields."""
    try:
        model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise AssertionError(f"{model.__name__} does not describe the answer: {exc}\n{json.dumps(data)[:2000]}") \
            from None


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
        strict(openapi.ChatCompletion, r.json())
        for _, chunk in events(thread, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}):
            strict(openapi.ChatCompletionChunk, chunk)
        r = post(thread, "/v1/completions", completion)
        assert r.status_code == 200, r.text
        strict(openapi.Completion, r.json())
        for _, chunk in events(thread, "/v1/completions", {**completion, "echo": False,
                                                           "stream_options": {"include_usage": True}}):
            strict(openapi.CompletionChunk, chunk)


@pytest.mark.parametrize("reply", [REASONED, CALL], ids=["reasoning", "tool-call"])
def test_anthropic_answers_are_the_documented_shapes(qwen3, reply):
    thread, engine = qwen3
    body = {"model": "tiny", "messages": HI, "max_tokens": 64, "tools": [ANTHROPIC_TOOL]}
    with scripted(engine, reply_ids(engine, reply)):
        r = post(thread, "/v1/messages", body)
        assert r.status_code == 200, r.text
        strict(openapi.AnthropicMessage, r.json())
        for name, event in events(thread, "/v1/messages", body):
            assert name == event["type"]
            strict(openapi.AnthropicStreamEvent, event)
    r = post(thread, "/v1/messages/count_tokens", {"model": "tiny", "messages": HI})
    strict(openapi.MessageTokensCount, r.json())


@pytest.mark.parametrize("reply", [REASONED, CALL], ids=["reasoning", "tool-call"])
def test_responses_answers_are_the_documented_shapes(qwen3, reply):
    thread, engine = qwen3
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 64, "tools": [RESPONSES_TOOL]}
    with scripted(engine, reply_ids(engine, reply)):
        r = post(thread, "/v1/responses", body)
        assert r.status_code == 200, r.text
        strict(openapi.ResponseObject, r.json())
        for name, event in events(thread, "/v1/responses", body):
            assert name == event["type"]
            strict(openapi.ResponseStreamEvent, event)
    r = post(thread, "/v1/responses/input_tokens", {"model": "tiny", "input": "Hi"})
    strict(openapi.InputTokensCount, r.json())


def test_the_other_routes_and_errors_are_the_documented_shapes(qwen3):
    thread, _ = qwen3
    auth = {"Authorization": f"Bearer {KEY}"}
    strict(openapi.ModelList, httpx.get(thread.url + "/v1/models", headers=auth).json())
    strict(openapi.ModelCard, httpx.get(thread.url + "/v1/models/tiny", headers=auth).json())
    strict(openapi.Health, httpx.get(thread.url + "/health").json())
    tokens = post(thread, "/tokenize", {"model": "tiny", "prompt": "Hi there", "return_token_strs": True}).json()
    strict(openapi.TokenizeResponse, tokens)
    detokenized = post(thread, "/detokenize", {"model": "tiny", "tokens": tokens["tokens"]}).json()
    strict(openapi.DetokenizeResponse, detokenized)
    for path, body in (("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": -1}),
                       ("/v1/completions", {"model": "tiny", "prompt": "Hi", "top_k": 10**9}),
                       ("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": -1})):
        r = post(thread, path, body)
        assert r.status_code == 400
        strict(openapi.ErrorResponse, r.json())
    r = post(thread, "/v1/messages", {"model": "tiny", "messages": HI, "max_tokens": -1})
    assert r.status_code == 400
    strict(openapi.AnthropicError, r.json())
