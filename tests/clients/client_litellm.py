"""litellm's `openai/` provider against lmport's base URL: completion, streaming, a forced tool call, a JSON schema
and embeddings."""
# pyright: reportMissingImports=false
# (the client libraries live in the suite's venvs, not in the .venv `make lint` checks with)
from __future__ import annotations

import os

# litellm fetches its model price list from the internet at import unless told to read its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import pytest  # noqa: E402

from clients.shapes import (API_KEY, DESCRIBE, GREETING, GREETING_TOKENS, MODEL, QUESTION,  # noqa: E402
                            STRUCTURED_TOKENS, TEXT_TOKENS, WEATHER_TOOL, City, check_usage, weather_arguments)

PROVIDER_MODEL = f"openai/{MODEL}"


@pytest.fixture
def call(base_url):
    def complete(**request):
        return litellm.completion(model=PROVIDER_MODEL, api_base=base_url, api_key=API_KEY, temperature=0,
                                  num_retries=0, **request)
    return complete


def test_completion(call):
    reply = call(messages=[{"role": "user", "content": QUESTION}], max_tokens=TEXT_TOKENS)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
    check_usage(reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens)


def test_streaming(call):
    chunks = list(call(messages=[{"role": "user", "content": GREETING}], max_tokens=GREETING_TOKENS, stream=True))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    reasons = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert text and reasons == ["stop"]
    whole = litellm.stream_chunk_builder(chunks)
    assert whole.choices[0].message.content == text


def test_forced_tool_call(call):
    reply = call(messages=[{"role": "user", "content": QUESTION}], max_tokens=STRUCTURED_TOKENS,
                 tools=[WEATHER_TOOL], tool_choice="required")
    (tool_call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and tool_call.function.name == "get_weather"
    weather_arguments(tool_call.function.arguments)


def test_response_format_pydantic(call):
    reply = call(messages=[{"role": "user", "content": DESCRIBE}], max_tokens=STRUCTURED_TOKENS, response_format=City)
    assert reply.choices[0].finish_reason == "stop"
    City.model_validate_json(reply.choices[0].message.content)


def test_embedding(base_url):
    reply = litellm.embedding(model=PROVIDER_MODEL, api_base=base_url, api_key=API_KEY,
                              input=["the first text", "a second, longer text"])
    vectors = [item["embedding"] for item in reply.data]
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 0 and vectors[0] != vectors[1]
