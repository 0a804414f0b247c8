"""OpenAI's Responses API (/v1/responses, stateless) through the official `openai` client.

A responses request is a translation into lmport's chat completions route, which is the reference: the same
conversation gives the same prompt tokens and, greedy, the same text. A tiny random-weight Qwen2 model with a
tool-aware template runs the quick cases; the default model (marked slow) shows the client working where the
text matters.
"""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from test_server import ServerThread, tool_model_server

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def tiny_server():
    server = tool_model_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


# -- the tiny model -------------------------------------------------------------------------------------------

def test_text_reply_equals_chat_completions(tiny):
    r = tiny.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.", max_output_tokens=8,
                              temperature=0)
    c = tiny.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == c.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    if c.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_stream_events_in_order_and_equal_to_the_reply(tiny_server, tiny):
    body = {"model": "tiny", "input": [{"role": "user", "content": "Hello"}], "max_output_tokens": 10,
            "temperature": 0}
    events = raw_events(tiny_server, body)
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    reply = tiny.responses.create(**body)
    final = events[-1][1]["response"]
    assert text == reply.output_text == final["output"][0]["content"][0]["text"]
    assert final["status"] == reply.status == "incomplete" and final["usage"]["output_tokens"] == 10
    with tiny.responses.stream(**body) as stream:   # the client's own accumulation of the events
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.output_text == reply.output_text


def test_function_call_round_trip(tiny_server, tiny):
    ask = [{"role": "user", "content": "Weather in Lima?"}]
    r = tiny.responses.create(model="tiny", input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=80,
                              temperature=0)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = raw_events(tiny_server, {"model": "tiny", "input": ask, "tools": [WEATHER], "max_output_tokens": 80,
                                      "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0})
    deltas = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    done = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert deltas == done[0]["arguments"] == call.arguments
    assert [n for n, _ in events if n.startswith("response.output_item")] == [
        "response.output_item.added", "response.output_item.done"]
    assert events[-1][0] == "response.completed"
    with tiny.responses.stream(model="tiny", input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=80,
                               temperature=0) as stream:
        assert stream.get_final_response().output[0].arguments == call.arguments
    # The result goes back as items; the prompt is the chat route's for the same conversation.
    items = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]
    again = tiny.responses.create(model="tiny", input=items, tools=[WEATHER], max_output_tokens=4, temperature=0)
    calls = [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]
    chat = tiny.chat.completions.create(model="tiny", max_tokens=1, temperature=0, tools=[CHAT_WEATHER], messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens


class City(pydantic.BaseModel):
    city: Literal["Paris", "Lima"]
    coastal: bool


def test_text_format_json_schema(tiny):
    schema = City.model_json_schema()
    r = tiny.responses.create(model="tiny", input="A city?", max_output_tokens=40, temperature=0, text={"format": {
        "type": "json_schema", "name": "city", "schema": {**schema, "additionalProperties": False}, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    parsed = tiny.responses.parse(model="tiny", input="A city?", max_output_tokens=40, temperature=0, text_format=City)
    assert isinstance(parsed.output_parsed, City)


@pytest.mark.parametrize("fields, field, fragment", [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "does not store responses"),
    ({"input": [{"type": "wat"}]}, "input.0", "'wat'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "stores none"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input.0.content.0.type", "'input_file' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "model 'tiny' takes no images"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input.0.arguments", "must be a JSON object"),
    ({"input": []}, "input", "the list is empty"),
    ({"tool_choice": "sometimes"}, "tool_choice", "'none', 'auto' or 'required'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name",
     "'nope' is not one of the tools"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "'web_search' tools are hosted by OpenAI"),
    ({"tools": [{**WEATHER, "parameters": {"type": "wat"}}]}, "tools.0.parameters", "not a valid JSON schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, "text.format",
     "not a valid JSON schema"),
    # Missing or out of range: the words after the field are pydantic's, not checked; the value is lmport's.
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", ""),
    ({"max_output_tokens": 0}, "max_output_tokens", "(got 0)"),
    ({"temperature": 3}, "temperature", "(got 3)"),
    ({"background": True}, "background", "not supported"),
])
def test_bad_input_names_the_field(tiny_server, fields, field, fragment):
    r = httpx.post(tiny_server.url + "/v1/responses", json={"model": "tiny", "input": "Hi", **fields}, timeout=600)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field) and fragment in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_previous_response_id_through_the_client(tiny):
    with pytest.raises(openai.BadRequestError) as info:
        tiny.responses.create(model="tiny", input="Hi", previous_response_id="resp_abc")
    assert info.value.code == "previous_response_not_found" and info.value.param == "previous_response_id"


# -- the default model ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    server = ServerThread(create_app(Engine("smollm2", EngineConfig(cache_max_entry_count=256)),
                                     model_name="smollm2"))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    server.stop()


class Capital(pydantic.BaseModel):
    country: str
    capital: str


@pytest.mark.slow
def test_default_model_responses_stream_tools_and_json_schema(smol):
    ask = "What is the capital of France? Answer in one word."
    r = smol.responses.create(model="smollm2", input=ask, max_output_tokens=20, temperature=0)
    assert r.status == "completed" and "Paris" in r.output_text
    deltas = [e.delta for e in smol.responses.create(model="smollm2", input=ask, max_output_tokens=20, temperature=0,
                                                     stream=True) if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text
    weather = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    call = smol.responses.create(model="smollm2", input=weather, tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=60, temperature=0).output[-1]
    assert call.type == "function_call" and json.loads(call.arguments)["city"] == "Paris"
    answer = smol.responses.create(model="smollm2", tools=[WEATHER], max_output_tokens=30, temperature=0, input=[
        *weather, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}])
    # The same conversation through chat completions gives the same reply (the model's wording is its own).
    calls = [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]
    reference = smol.chat.completions.create(model="smollm2", max_tokens=30, temperature=0, tools=[CHAT_WEATHER],
                                             messages=[*weather, {"role": "assistant", "content": None,
                                                                  "tool_calls": calls},
                                                       {"role": "tool", "tool_call_id": call.call_id,
                                                        "content": "21 degrees"}])
    assert answer.output_text == reference.choices[0].message.content
    parsed = smol.responses.parse(model="smollm2", input="Give the capital of Japan as JSON.", temperature=0,
                                  max_output_tokens=60, text_format=Capital)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Capital)
    jsonschema.validate(json.loads(parsed.output_text), Capital.model_json_schema())


def test_openapi_describes_the_route_and_the_replies_conform(tiny_server):
    doc = httpx.get(tiny_server.url + "/openapi.json", timeout=600).json()

    def conforms(name, instance):
        jsonschema.validate(instance, {**doc, "$ref": f"#/components/schemas/{name}"})
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ResponsesRequest")
    body = {"model": "tiny", "input": "Hi", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 80}
    conforms("ResponsesRequest", body)
    with pytest.raises(jsonschema.ValidationError):
        conforms("ResponsesRequest", {**body, "previous_response_id": "resp_1"})
    conforms("ResponseObject", httpx.post(tiny_server.url + "/v1/responses", json=body, timeout=600).json())
    conforms("ErrorResponse", httpx.post(tiny_server.url + "/v1/responses", json={**body, "max_output_tokens": 0},
                                         timeout=600).json())
    for _, data in raw_events(tiny_server, body):
        conforms("ResponseStreamEvent", data)
        if "response" in data:
            conforms("ResponseObject", data["response"])
