"""langchain-openai's ChatOpenAI: `bind_tools`, `with_structured_output` in its three methods, and the Responses
API (`use_responses_api=True`)."""
# pyright: reportMissingImports=false
# (the client libraries live in the suite's venvs, not in the .venv `make lint` checks with)
from __future__ import annotations

import pytest
from langchain_openai import ChatOpenAI

from clients.shapes import (API_KEY, DESCRIBE, MODEL, QUESTION, STRUCTURED_TOKENS, TEXT_TOKENS, City, GetWeather,
                            check_usage)

# json_mode constrains the reply to a JSON object, not to a schema: parsed against a plain JSON schema it comes
# back as a dict, whatever keys the model chose.
ANY_CITY = {"title": "City", "description": "A city", "type": "object", "properties": {}}


def chat(base_url: str, max_tokens: int, **options) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=base_url, api_key=API_KEY, temperature=0, max_tokens=max_tokens,
                      max_retries=0, **options)


APIS = {"chat_completions": {}, "responses": {"use_responses_api": True}}


@pytest.mark.parametrize("api", APIS)
def test_invoke(base_url, api):
    reply = chat(base_url, TEXT_TOKENS, **APIS[api]).invoke(QUESTION)
    assert reply.text
    usage = reply.usage_metadata
    check_usage(usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("tool_choice", ["required", "GetWeather"])
def test_bind_tools_forced(base_url, api, tool_choice):
    llm = chat(base_url, STRUCTURED_TOKENS, **APIS[api]).bind_tools([GetWeather], tool_choice=tool_choice)
    reply = llm.invoke(QUESTION)
    (call,) = reply.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    GetWeather.model_validate(call["args"])
    assert not reply.invalid_tool_calls


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(base_url, api, method):
    llm = chat(base_url, STRUCTURED_TOKENS, **APIS[api]).with_structured_output(City, method=method)
    assert isinstance(llm.invoke(DESCRIBE), City)


def test_with_structured_output_json_mode(base_url):
    llm = chat(base_url, STRUCTURED_TOKENS).with_structured_output(ANY_CITY, method="json_mode")
    assert isinstance(llm.invoke(DESCRIBE), dict)
