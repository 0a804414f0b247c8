"""llama-index's OpenAILike: completion (the completions route and through chat), chat, streamed chat, a forced
tool call and `structured_predict`."""
# pyright: reportMissingImports=false
# (the client libraries live in the suite's venvs, not in the .venv `make lint` checks with)
from __future__ import annotations

import pytest
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

from clients.shapes import (API_KEY, DESCRIBE, GREETING, GREETING_TOKENS, MODEL, QUESTION, STRUCTURED_TOKENS,
                            TEXT_TOKENS, City, check_usage, get_weather, weather_arguments)

CONTEXT_WINDOW = 8192


def llm(base_url: str, max_tokens: int, is_chat_model: bool = True) -> OpenAILike:
    return OpenAILike(model=MODEL, api_base=base_url, api_key=API_KEY, is_chat_model=is_chat_model,
                      is_function_calling_model=True, context_window=CONTEXT_WINDOW, max_tokens=max_tokens,
                      temperature=0, max_retries=0)


@pytest.mark.parametrize("is_chat_model", [False, True], ids=["completions", "chat"])
def test_complete(base_url, is_chat_model):
    # Raw text on /v1/completions (no template): a model may end it at once, so the text may be empty.
    reply = llm(base_url, TEXT_TOKENS, is_chat_model).complete(QUESTION)
    assert isinstance(reply.text, str) and (reply.text or not is_chat_model)
    assert reply.raw.choices[0].finish_reason in ("stop", "length")
    usage = reply.raw.usage
    check_usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def test_chat(base_url):
    reply = llm(base_url, TEXT_TOKENS).chat([ChatMessage(role="user", content=QUESTION)])
    assert reply.message.role == "assistant" and reply.message.content


def test_stream_chat(base_url):
    chunks = list(llm(base_url, GREETING_TOKENS).stream_chat([ChatMessage(role="user", content=GREETING)]))
    text = "".join(chunk.delta or "" for chunk in chunks)
    assert text and chunks[-1].message.content == text


def test_forced_tool_call(base_url):
    model = llm(base_url, STRUCTURED_TOKENS)
    reply = model.chat_with_tools([FunctionTool.from_defaults(fn=get_weather)], user_msg=QUESTION, tool_required=True)
    (selection,) = model.get_tool_calls_from_response(reply, error_on_no_tool_call=True)
    assert selection.tool_name == "get_weather"
    weather_arguments(selection.tool_kwargs)


def test_structured_predict(base_url):
    city = llm(base_url, STRUCTURED_TOKENS).structured_predict(City, PromptTemplate(DESCRIBE))
    assert isinstance(city, City)
