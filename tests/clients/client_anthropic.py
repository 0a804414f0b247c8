"""The `anthropic` client against `/v1/messages`: messages, streams (text and a forced tool call), the tool runner."""
from __future__ import annotations

import anthropic
import pytest

from clients.shapes import (API_KEY, GREETING, GREETING_TOKENS, MODEL, QUESTION, STRUCTURED_TOKENS, TEXT_TOKENS,
                            WEATHER_PARAMETERS, check_usage, get_weather, weather_arguments)

MESSAGES = [{"role": "user", "content": QUESTION}]
WEATHER_TOOL = {"name": "get_weather", "description": "Get the current weather in a city.",
                "input_schema": WEATHER_PARAMETERS}
# Anthropic's newer SDKs take no sampling arguments: they go in the body as extra fields.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key=API_KEY, max_retries=0)


def test_message(client):
    message = client.messages.create(model=MODEL, max_tokens=TEXT_TOKENS, messages=MESSAGES, **GREEDY)
    assert message.role == "assistant" and [block.type for block in message.content] == ["text"]
    assert message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    check_usage(message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0),
                message.usage.output_tokens)


def test_stream_text(client):
    with client.messages.stream(model=MODEL, max_tokens=GREETING_TOKENS,
                                messages=[{"role": "user", "content": GREETING}], **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and [block.type for block in final.content] == ["text"] and final.content[0].text == text
    assert final.stop_reason == "end_turn"
    check_usage(final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0), final.usage.output_tokens)


def test_forced_tool_use(client):
    message = client.messages.create(model=MODEL, max_tokens=STRUCTURED_TOKENS, messages=MESSAGES,
                                     tools=[WEATHER_TOOL], tool_choice={"type": "any"}, **GREEDY)
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and call.name == "get_weather" and call.id
    weather_arguments(call.input)


def test_stream_of_a_named_tool_use(client):
    with client.messages.stream(model=MODEL, max_tokens=STRUCTURED_TOKENS, messages=MESSAGES, tools=[WEATHER_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = "".join(event.delta.partial_json for event in events
                     if event.type == "content_block_delta" and event.delta.type == "input_json_delta")
    (call,) = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use" and call.name == "get_weather"
    assert weather_arguments(pieces) == weather_arguments(call.input)


def test_tool_runner_runs_the_tool_and_sends_its_result_back(client):
    """The SDK's default runner continues a thread with only the new tool result; lmport refuses `thread` with
    `thread_unsupported_request`, on which the runner sends the whole conversation instead."""
    calls = []

    @anthropic.beta_tool
    def weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city's name.
        """
        calls.append(city)
        return get_weather(city)

    # A forced call on every turn: two turns are the call and the reply that reads its result.
    runner = client.beta.messages.tool_runner(model=MODEL, max_tokens=STRUCTURED_TOKENS, messages=MESSAGES,
                                              tools=[weather], tool_choice={"type": "any"}, max_iterations=2,
                                              **GREEDY)
    replies = list(runner)
    assert len(replies) == 2 and all(reply.stop_reason == "tool_use" for reply in replies)
    assert len(calls) >= 1 and all(isinstance(city, str) and city for city in calls)
    first_call = next(block for block in replies[0].content if block.type == "tool_use")
    assert first_call.input == {"city": calls[0]}


def test_models_list_and_retrieve_carry_anthropics_fields(client):
    """The SDK's ModelInfo: type, display_name and created_at (a datetime), on one page."""
    page = client.models.list()
    assert [m.id for m in page.data][:1] == [MODEL] and page.has_more is False
    model = client.models.retrieve(MODEL)
    for info in (page.data[0], model):
        assert info.type == "model" and info.display_name and info.created_at.year >= 2024
