"""openai-agents: a function tool, `output_type` with `tool_choice="required"`, and streamed runs, over both of
its model APIs (chat completions and Responses)."""
# pyright: reportMissingImports=false
# (the client libraries live in the suite's venvs, not in the .venv `make lint` checks with)
from __future__ import annotations

import asyncio

import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

from clients.shapes import API_KEY, MODEL, QUESTION, STRUCTURED_TOKENS, City, get_weather

# Traces would go to OpenAI's servers.
set_tracing_disabled(True)

MODEL_APIS = {"chat_completions": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}
FORCED = ModelSettings(tool_choice="required", temperature=0, max_tokens=STRUCTURED_TOKENS)


def weather_agent(base_url: str, api: str, calls: list[str], once: bool = False, **options) -> Agent:
    """An agent on lmport whose one tool records the cities it is asked about; with ``once`` the tool is offered
    until it has run."""

    @function_tool(is_enabled=lambda _context, _agent: not (once and calls))
    def weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city's name.
        """
        calls.append(city)
        return get_weather(city)

    # A client per run: an async client belongs to the event loop it first ran on.
    model = MODEL_APIS[api](model=MODEL, openai_client=AsyncOpenAI(base_url=base_url, api_key=API_KEY,
                                                                   max_retries=0))
    return Agent(name="weather", instructions="Answer questions about the weather.", model=model,
                 tools=[weather], model_settings=FORCED, **options)


@pytest.mark.parametrize("api", MODEL_APIS)
def test_forced_tool_call_runs_the_tool(base_url, api):
    calls: list[str] = []
    agent = weather_agent(base_url, api, calls, tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=2))
    assert len(calls) == 1 and calls[0] and result.final_output == get_weather(calls[0])
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]


@pytest.mark.parametrize("api", MODEL_APIS)
def test_output_type_with_a_required_tool(base_url, api):
    """Every turn carries the output type's format. The first must call the tool (a forced call's turn is the call,
    the format applies to text turns); the tool is then withdrawn, so the second is the output type's JSON.
    (Left to choose under `auto`, the model may call the tool again at every turn.)"""
    calls: list[str] = []
    agent = weather_agent(base_url, api, calls, once=True, output_type=City)
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=2))
    assert len(calls) == 1 and isinstance(result.final_output, City)
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                        "message_output_item"]


@pytest.mark.parametrize("api", MODEL_APIS)
def test_streamed_run(base_url, api):
    calls: list[str] = []
    agent = weather_agent(base_url, api, calls, tool_use_behavior="stop_on_first_tool")

    async def run():
        result = Runner.run_streamed(agent, QUESTION, max_turns=2)
        events = [event async for event in result.stream_events()]
        return result, events

    result, events = asyncio.run(run())
    raw = [event for event in events if event.type == "raw_response_event"]
    items = [event.item.type for event in events if event.type == "run_item_stream_event"]
    assert raw and items == ["tool_call_item", "tool_call_output_item"]
    assert len(calls) == 1 and result.final_output == get_weather(calls[0])
