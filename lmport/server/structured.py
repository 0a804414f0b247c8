"""Structured outputs on the routes: a request's response_format (or vLLM's guided_* fields), checked up front.

The format is compiled here, in the server's compile thread (off the event loop, within COMPILE_TIMEOUT),
so a schema the grammar engine refuses is a 400 naming the field before anything is queued.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from lmport.structured_output.grammar import MAX_ENUM_VALUES, GuidedDecodingError, Grammars
from lmport.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, StructuredOutputs

# vLLM's fields, then llama.cpp's names for two of them.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "grammar", "json_schema")


def request_format(req: ChatCompletionRequest | CompletionRequest) -> tuple[dict | None, str]:
    """(response_format, the field it came from) of a request."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
             if getattr(req, name) is not None]
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: give one of response_format, structured_outputs, {', '.join(GUIDED_FIELDS)}, "
                            f"not {' and '.join(given)}", param=given[1])
    if not given or given[0] == "response_format":
        return req.response_format, "response_format"
    name = param = given[0]
    value = getattr(req, name)
    if name == "structured_outputs":   # vLLM's newer form of the guided_* fields
        name, value, param = _structured_outputs(value)
        if name == "json_object":
            return {"type": "json_object"}, param
    if name in ("guided_json", "json_schema"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"{param}: not valid JSON: {exc}", param=param) from None
        return {"type": "json_schema", "json_schema": {"name": param.replace(".", "_"), "schema": value}}, param
    if name == "guided_regex":
        return {"type": "regex_schema", "regex_schema": value}, param
    if name in ("guided_grammar", "grammar"):
        return {"type": "grammar", "grammar": value}, param
    if not value or not all(value):
        raise APIError(400, f"{param}: give a list of non-empty strings", param=param)
    if len(value) > MAX_ENUM_VALUES:
        raise APIError(400, f"{param}: {len(value)} choices is more than the {MAX_ENUM_VALUES} the server "
                            f"compiles; give fewer", param=param)
    return {"type": "regex_schema", "regex_schema": "|".join(f"({re.escape(c)})" for c in value)}, param


# structured_outputs' constraints as the guided_* field each stands for.
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar", "json_object": "json_object"}


def _structured_outputs(value: StructuredOutputs) -> tuple[str, Any, str]:
    """(the guided_* field, its value, the param to name) that a structured_outputs object stands for."""
    if value.whitespace_pattern is not None:
        raise APIError(400, "structured_outputs.whitespace_pattern: not supported by this server (JSON is compiled "
                            "without free whitespace); leave it out", param="structured_outputs.whitespace_pattern",
                       code="unsupported_parameter")
    given = value.constraints()
    if len(given) != 1:
        got = ", ".join(key for key, _ in given) or "none"
        raise APIError(400, f"structured_outputs: give exactly one of {', '.join(STRUCTURED_OUTPUTS)} (got {got})",
                       param="structured_outputs")
    key, constraint = given[0]
    param = f"structured_outputs.{key}"
    if key not in STRUCTURED_OUTPUTS:
        raise APIError(400, f"{param}: not supported by this server; use json, regex, choice or grammar",
                       param=param, code="unsupported_parameter")
    return STRUCTURED_OUTPUTS[key], constraint, param


def constrains(response_format: dict | None) -> bool:
    return response_format is not None and response_format.get("type") != "text"


COMPILE_TIMEOUT = 10.0   # seconds a request's formats may take to compile before it is refused


async def off_loop(frontend, fn, *args):
    """``fn(*args)`` in the server's compile thread (xgrammar releases the GIL), never on the event loop; a 400
    when it takes longer than COMPILE_TIMEOUT (it finishes in the background, its result cached)."""
    future = frontend.compile_pool.submit(fn, *args)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), COMPILE_TIMEOUT)
    except TimeoutError:
        raise APIError(400, f"the structured-output format or tools took more than {COMPILE_TIMEOUT:g} s to "
                            f"compile: simplify them", code="format_too_complex") from None


async def check_format(frontend, response_format: dict | None, param: str) -> None:
    """Compile (and cache) the format now, off the event loop; a bad one is a 400 that names ``param``."""
    if response_format is not None:
        await off_loop(frontend, check_format_now, frontend.grammars, response_format, param)


def check_format_now(grammars: Grammars, response_format: dict | None, param: str) -> None:
    try:
        grammars.compile(response_format)
    except GuidedDecodingError as exc:
        message = str(exc)
        if param != "response_format":
            message = message.replace("response_format", param, 1)
        raise APIError(400, message if message.startswith(param) else f"{param}: {message}", param=param) from None
