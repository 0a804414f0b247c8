"""instructor on the openai client: Mode.JSON_SCHEMA and Mode.TOOLS, each with a reply its validator refuses once, so
the retry (the refused answer and the error sent back as history) is part of the run."""
# pyright: reportMissingImports=false
# (the client libraries live in the suite's venvs, not in the .venv `make lint` checks with)
from __future__ import annotations

import instructor
import openai
import pytest
from pydantic import field_validator

from clients.shapes import API_KEY, DESCRIBE, MODEL, STRUCTURED_TOKENS, City

MODES = {"JSON_SCHEMA": instructor.Mode.JSON_SCHEMA, "TOOLS": instructor.Mode.TOOLS}


@pytest.mark.parametrize("mode", MODES)
def test_first_answer_valid(base_url, mode):
    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0),
                                    mode=MODES[mode])
    city = client.chat.completions.create(model=MODEL, response_model=City, max_retries=0, temperature=0,
                                          max_tokens=STRUCTURED_TOKENS,
                                          messages=[{"role": "user", "content": DESCRIBE}])
    assert isinstance(city, City)


@pytest.mark.parametrize("mode", MODES)
def test_retry_after_a_refused_answer(base_url, mode):
    names: list[str] = []

    class CheckedCity(City):
        @field_validator("name")
        @classmethod
        def refuse_the_first(cls, name: str) -> str:
            names.append(name)
            if len(names) == 1:
                raise ValueError("give the city's name again")
            return name

    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0),
                                    mode=MODES[mode])
    city = client.chat.completions.create(model=MODEL, response_model=CheckedCity, max_retries=2, temperature=0,
                                          max_tokens=STRUCTURED_TOKENS,
                                          messages=[{"role": "user", "content": DESCRIBE}])
    assert isinstance(city, CheckedCity) and len(names) == 2 and city.name == names[1]
