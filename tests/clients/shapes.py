"""What the client tests ask for: one tool and one structured answer, and the checks every client's reply gets.

The model is tiny, so its free text is nonsense: a test checks the contract (shapes, finish reasons, counts), and
where the server constrains decoding (a forced tool call, a JSON schema) that the result is valid. Every string and
number is bounded, so a constrained answer fits within ``STRUCTURED_TOKENS`` whatever the model chooses.
"""
from __future__ import annotations

import json

from pydantic import BaseModel, Field

MODEL = "smollm2"
API_KEY = "none"
# Free text: enough to see a reply and a finish reason.
TEXT_TOKENS = 16
# A forced call or a schema's JSON: room for the bounded fields below with the model's own whitespace.
STRUCTURED_TOKENS = 128
QUESTION = "What is the weather in Paris?"
# A prompt the model answers in a few tokens and ends (a greeting), for the helpers that refuse a reply cut short.
GREETING = "Hi"
# Room for that whole answer.
GREETING_TOKENS = 48
DESCRIBE = "Describe Paris as JSON with its name and population."


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=24, description="The city's name")


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name.
    """
    return f"Sunny in {city}"


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24, "description": "The city's name"}},
    "required": ["city"],
    "additionalProperties": False,
}
# Chat completions' function tool, as a client passes it unchanged.
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather "
                                                  "in a city.", "parameters": WEATHER_PARAMETERS}}


def weather_arguments(arguments: str | dict) -> GetWeather:
    """A call's arguments (JSON text or an object), validated against the tool's parameters."""
    return GetWeather.model_validate(json.loads(arguments) if isinstance(arguments, str) else arguments)


def check_usage(prompt_tokens: int, completion_tokens: int, total_tokens: int | None = None) -> None:
    assert prompt_tokens > 0 and completion_tokens > 0, (prompt_tokens, completion_tokens)
    if total_tokens is not None:
        assert total_tokens == prompt_tokens + completion_tokens, (prompt_tokens, completion_tokens, total_tokens)
