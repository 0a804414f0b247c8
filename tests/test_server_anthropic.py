"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic` client.

The reference is lmport's own chat completions route: a messages request is a translation into it, so the same
conversation must give the same prompt tokens and, greedy, the same text. A tiny random-weight Qwen2 model with a
tool-aware template runs the quick cases (shapes, events, tool round trips, bad input); the default model
(marked slow) shows the client working where the text matters.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from support.model_helpers import tiny_tool_model_dir
from test_server import ServerThread, tool_model_server

KEY = "sk-anthropic-test"
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}
GREEDY = {"temperature": 0}   # this anthropic client sends sampling fields only through extra_body


@pytest.fixture(scope="module")
def tiny_server():
    server = tool_model_server(api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny(tiny_server):
    return anthropic.Anthropic(base_url=tiny_server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tiny_openai(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=KEY, max_retries=0)


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed /v1/messages reply, read off the wire."""
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY}, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


def chat_messages(system: str, conversation: list[dict]) -> list[dict]:
    return [{"role": "system", "content": system}, *conversation]


# -- the tiny model -------------------------------------------------------------------------------------------

def test_text_reply_equals_chat_completions(tiny, tiny_openai):
    conversation = [{"role": "user", "content": "Name a colour."}]
    m = tiny.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=conversation,
                             extra_body=GREEDY)
    c = tiny_openai.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                            messages=chat_messages("Be brief.", conversation))
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == "tiny"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens
    count = tiny.messages.count_tokens(model="tiny", system="Be brief.", messages=conversation)
    assert count.input_tokens == c.usage.prompt_tokens


def test_stream_events_in_order_and_equal_to_the_reply(tiny_server, tiny):
    body = {"model": "tiny", "max_tokens": 12, "messages": [{"role": "user", "content": "Hello"}], **GREEDY}
    events = raw_events(tiny_server, body)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    reply = tiny.messages.create(model="tiny", max_tokens=12, messages=body["messages"], extra_body=GREEDY)
    assert text == reply.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": reply.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == reply.usage.output_tokens == 12
    with tiny.messages.stream(model="tiny", max_tokens=12, messages=body["messages"], extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [b.text for b in reply.content]
    assert final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens


def test_stop_sequence_is_named(tiny):
    messages = [{"role": "user", "content": "Count."}]
    free = tiny.messages.create(model="tiny", max_tokens=16, messages=messages, extra_body=GREEDY).content[0].text
    word = free[len(free) // 2:len(free) // 2 + 3]
    cut = tiny.messages.create(model="tiny", max_tokens=16, messages=messages, stop_sequences=["\u2603", word],
                               extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == free[:free.index(word)]


def test_prefill_continues_the_assistant_turn(tiny, tiny_openai):
    conversation = [{"role": "user", "content": "Say something."}]
    prefill = "Sure, here it is:"
    m = tiny.messages.create(model="tiny", max_tokens=6, messages=[*conversation, {"role": "assistant",
                                                                                   "content": prefill}],
                             extra_body=GREEDY)
    tok = AutoTokenizer.from_pretrained(tiny_tool_model_dir())
    ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids) + tok.encode(prefill, add_special_tokens=False)
    c = tiny_openai.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert m.content[0].text == c.choices[0].text
    assert m.usage.input_tokens == len(ids)


def test_tool_use_round_trip(tiny, tiny_server, tiny_openai):
    ask = [{"role": "user", "content": "Weather in Lima?"}]
    m = tiny.messages.create(model="tiny", max_tokens=80, messages=ask, tools=[WEATHER], tool_choice={"type": "any"},
                             extra_body=GREEDY)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # The stream's input_json_delta pieces build the same input.
    events = raw_events(tiny_server, {"model": "tiny", "max_tokens": 80, "messages": ask, "tools": [WEATHER],
                                      "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY})
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b["name"], b["input"]) for b in starts] == [("tool_use", "get_weather", {})]
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == call.input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # The result goes back; the prompt is the chat route's for the same conversation.
    history = [*ask, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call.model_dump(
        include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"},
                                     {"type": "text", "text": "Thanks."}]}]
    reply = tiny.messages.create(model="tiny", max_tokens=4, messages=history, tools=[WEATHER], extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    chat = tiny_openai.chat.completions.create(
        model="tiny", max_tokens=1, temperature=0, tools=[{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        messages=[*ask, {"role": "assistant", "content": "Checking.", "tool_calls": [{
            "id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}, {"role": "user", "content": "Thanks."}])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert tiny.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER]).input_tokens == \
        chat.usage.prompt_tokens


def test_output_config_json_schema(tiny):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"],
              "additionalProperties": False}
    m = tiny.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "A city?"}],
                             extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}},
                                         **GREEDY})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def _body(**fields) -> dict:
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **fields}


@pytest.mark.parametrize("body, status, kind, field", [
    (_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video"}]}]), 400,
     "invalid_request_error", "messages.0.content.1"),
    (_body(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "aGk="}}]}]), 400,
     "invalid_request_error", "messages: model 'tiny' takes no images"),   # a text model (docs/vision.md)
    (_body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]), 400,
     "invalid_request_error", "messages.0.content.0.input"),
    (_body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     400, "invalid_request_error", "messages.0.content.0: tool_use blocks belong in assistant messages"),
    (_body(tools=[WEATHER], tool_choice={"type": "sometimes"}), 400, "invalid_request_error", "tool_choice.type"),
    (_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), 400, "invalid_request_error",
     "tool_choice.name: 'nope' is not one of the tools"),
    (_body(tools=[WEATHER], tool_choice={"type": "tool"}), 400, "invalid_request_error", "tool_choice.name"),
    (_body(tool_choice={"type": "any"}), 400, "invalid_request_error", "tool_choice: there are no tools"),
    (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "invalid_request_error",
     "tools.0: 'web_search_20250305' is one of Anthropic's server tools"),
    (_body(tools=[{**WEATHER, "input_schema": {"type": "wat"}}]), 400, "invalid_request_error",
     "tools.0.input_schema"),
    (_body(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error", "max_tokens"),
    (_body(temperature=1.5), 400, "invalid_request_error", "temperature"),
    (_body(messages=[{"role": "system", "content": "x"}]), 400, "invalid_request_error", "messages.0.role"),
    (_body(messages=[]), 400, "invalid_request_error", "messages: the list is empty"),
    (_body(stop_sequences=[""]), 400, "invalid_request_error", "stop_sequences.0"),
    (_body(model="claude-sonnet-4-5"), 404, "not_found_error", "model: 'claude-sonnet-4-5' does not exist"),
])
def test_bad_input_names_the_field_in_anthropics_shape(tiny_server, body, status, kind, field):
    r = httpx.post(tiny_server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=600)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind, error
    assert error["error"]["message"].startswith(field), error


def test_errors_before_the_route_have_anthropics_shape_too(tiny_server, tiny):
    r = httpx.post(tiny_server.url + "/v1/messages", json=_body(), timeout=600)   # no key
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(tiny_server.url + "/v1/messages", content=b"{}", timeout=60,
                   headers={"x-api-key": KEY, "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    r = httpx.post(tiny_server.url + "/v1/messages/count_tokens", content=b"{not json", timeout=60,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        tiny.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {}}]}])
    assert "messages.0.content.0.type" in str(info.value)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=tiny_server.url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="tiny", messages=[{"role": "user", "content": "Hi"}])


# -- the default model ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_server():
    server = ServerThread(create_app(Engine("smollm2", EngineConfig(cache_max_entry_count=256)),
                                     model_name="smollm2", api_key=KEY))
    yield server
    server.stop()


@pytest.mark.slow
def test_default_model_messages_stream_and_tool_round_trip(smol_server):
    smol = anthropic.Anthropic(base_url=smol_server.url, api_key=KEY, max_retries=0)
    chat = openai.OpenAI(base_url=smol_server.url + "/v1", api_key=KEY, max_retries=0)
    ask = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    m = smol.messages.create(model="smollm2", max_tokens=20, messages=ask, extra_body=GREEDY)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text"
    # What the model answers is its own: the same greedy reply as through chat completions.
    same = chat.chat.completions.create(model="smollm2", max_tokens=20, temperature=0, messages=ask)
    assert m.content[0].text == same.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[same.choices[0].finish_reason]
    with smol.messages.stream(model="smollm2", max_tokens=20, messages=ask, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == m.content[0].text == final.content[0].text
    weather = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    call = smol.messages.create(model="smollm2", max_tokens=60, messages=weather, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY)
    assert call.stop_reason == "tool_use"
    use = call.content[-1]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    answer = smol.messages.create(model="smollm2", max_tokens=30, tools=[WEATHER], extra_body=GREEDY, messages=[
        *weather, {"role": "assistant", "content": [b.model_dump(include={"type", "id", "name", "input", "text"})
                                                    for b in call.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    # The same conversation through chat completions gives the same reply (the model's wording is its own).
    reference = chat.chat.completions.create(
        model="smollm2", max_tokens=30, temperature=0, tools=[{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        messages=[*weather, {"role": "assistant", "content": "".join(b.text for b in call.content if b.type == "text")
                             or None, "tool_calls": [{"id": use.id, "type": "function", "function": {
                                 "name": use.name, "arguments": json.dumps(use.input)}}]},
                  {"role": "tool", "tool_call_id": use.id, "content": "21 degrees"}])
    assert answer.content[0].text == reference.choices[0].message.content


def test_openapi_describes_the_routes_and_the_replies_conform(tiny_server):
    doc = httpx.get(tiny_server.url + "/openapi.json", headers={"x-api-key": KEY}, timeout=600).json()

    def conforms(name, instance):
        jsonschema.validate(instance, {**doc, "$ref": f"#/components/schemas/{name}"})
    for path, request in (("/v1/messages", "MessagesRequest"), ("/v1/messages/count_tokens", "CountTokensRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request)
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("AnthropicError")
    body = {"model": "tiny", "max_tokens": 60, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
            "tool_choice": {"type": "any"}}
    conforms("MessagesRequest", body)
    headers = {"x-api-key": KEY}
    conforms("AnthropicMessage", httpx.post(tiny_server.url + "/v1/messages", json=body, headers=headers,
                                            timeout=600).json())
    conforms("MessageTokensCount", httpx.post(tiny_server.url + "/v1/messages/count_tokens", json=body,
                                              headers=headers, timeout=600).json())
    conforms("AnthropicError", httpx.post(tiny_server.url + "/v1/messages", json={**body, "max_tokens": 0},
                                          headers=headers, timeout=600).json())
    for _, data in raw_events(tiny_server, body):
        conforms("AnthropicStreamEvent", data)
