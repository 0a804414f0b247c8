"""The `openai` client: chat, its stream helpers with tool-call accumulation, `parse`, Responses and embeddings."""
from __future__ import annotations

import math

import openai
import pytest

from clients.shapes import (API_KEY, DESCRIBE, GREETING, GREETING_TOKENS, MODEL, QUESTION, STRUCTURED_TOKENS,
                            TEXT_TOKENS, WEATHER_PARAMETERS, City, GetWeather, check_usage, weather_arguments)

MESSAGES = [{"role": "user", "content": QUESTION}]
# The Responses API's function tool: flat, not nested under "function".
RESPONSES_WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a "
                          "city.", "parameters": WEATHER_PARAMETERS, "strict": True}


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)


def test_chat_completion(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=TEXT_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    check_usage(reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens)
    assert choice.finish_reason == "stop" or reply.usage.completion_tokens == TEXT_TOKENS


def test_history_with_a_call_that_has_empty_arguments(client):
    """Clients send a call of a function without parameters with ``"arguments": ""`` in the history."""
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=TEXT_TOKENS,
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


# Both homes of the helper: the current one and the beta one older code still calls.
STREAM_HELPERS = {"chat.completions.stream": lambda c: c.chat.completions,
                  "beta.chat.completions.stream": lambda c: c.beta.chat.completions}


@pytest.mark.parametrize("home", STREAM_HELPERS)
def test_stream_helper_text(client, home):
    # get_final_completion() refuses a reply the length limit cut: a greeting ends by itself.
    with STREAM_HELPERS[home](client).stream(model=MODEL, messages=[{"role": "user", "content": GREETING}],
                                             max_tokens=GREETING_TOKENS, temperature=0,
                                             stream_options={"include_usage": True}) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = "".join(event.delta for event in events if event.type == "content.delta")
    done = [event.content for event in events if event.type == "content.done"]
    assert deltas and done == [deltas] and final.choices[0].message.content == deltas
    assert final.choices[0].finish_reason == "stop"
    check_usage(final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.total_tokens)


@pytest.mark.parametrize("home", STREAM_HELPERS)
def test_stream_helper_accumulates_a_forced_tool_call(client, home):
    with STREAM_HELPERS[home](client).stream(model=MODEL, messages=MESSAGES, max_tokens=STRUCTURED_TOKENS,
                                             temperature=0, tools=[openai.pydantic_function_tool(GetWeather)],
                                             tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_completion()
    pieces = "".join(event.arguments_delta for event in events if event.type == "tool_calls.function.arguments.delta")
    done = [event for event in events if event.type == "tool_calls.function.arguments.done"]
    assert [event.name for event in done] == ["GetWeather"]
    assert isinstance(done[0].parsed_arguments, GetWeather) and done[0].arguments == pieces
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert len(message.tool_calls) == 1 and message.tool_calls[0].function.arguments == pieces
    assert message.tool_calls[0].function.parsed_arguments == done[0].parsed_arguments


def test_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": DESCRIBE}],
                                          response_format=City, max_tokens=STRUCTURED_TOKENS, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, City)


def test_parse_with_a_named_tool(client):
    reply = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=STRUCTURED_TOKENS,
                                          temperature=0, tools=[openai.pydantic_function_tool(GetWeather)],
                                          tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_responses_text(client):
    response = client.responses.create(model=MODEL, instructions="Be brief.", input=QUESTION,
                                       max_output_tokens=TEXT_TOKENS, temperature=0)
    assert response.output_text
    assert response.status == "completed" or (response.status == "incomplete" and
                                              response.incomplete_details.reason == "max_output_tokens")
    check_usage(response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens)


def test_responses_forced_function_call(client):
    response = client.responses.create(model=MODEL, input=QUESTION, tools=[RESPONSES_WEATHER_TOOL],
                                       tool_choice="required", max_output_tokens=STRUCTURED_TOKENS, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    weather_arguments(calls[0].arguments)


def test_responses_parse(client):
    response = client.responses.parse(model=MODEL, input=DESCRIBE, text_format=City,
                                      max_output_tokens=STRUCTURED_TOKENS, temperature=0)
    assert response.status == "completed" and isinstance(response.output_parsed, City)


def test_responses_stream(client):
    with client.responses.stream(model=MODEL, input=QUESTION, tools=[RESPONSES_WEATHER_TOOL],
                                 tool_choice="required", max_output_tokens=STRUCTURED_TOKENS,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    pieces = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.arguments == pieces
    weather_arguments(call.arguments)


def test_responses_input_tokens_count_what_a_response_reads(client):
    request = {"model": MODEL, "instructions": "Be brief.", "input": QUESTION, "tools": [RESPONSES_WEATHER_TOOL]}
    counted = client.responses.input_tokens.count(**request)
    response = client.responses.create(**request, max_output_tokens=TEXT_TOKENS, temperature=0)
    assert counted.input_tokens == response.usage.input_tokens > 0


def test_embeddings(client):
    texts = ["the first text", "a second, longer text"]
    packed = client.embeddings.create(model=MODEL, input=texts)   # base64, decoded by the client
    plain = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [item.index for item in packed.data] == [0, 1]
    for a, b in zip(packed.data, plain.data):
        assert len(a.embedding) == len(b.embedding) > 0
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
    assert packed.data[0].embedding != packed.data[1].embedding
    # No sentence-transformers configuration: last-token pooling, normalized (docs/embeddings.md).
    assert math.isclose(math.hypot(*plain.data[0].embedding), 1.0, rel_tol=1e-4)
    assert packed.usage.prompt_tokens == packed.usage.total_tokens > 0
