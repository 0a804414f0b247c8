"""Tool-call formats: the text a model family writes a call in, chosen from its chat template.

``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``: Qwen 2.5/3, Hermes; lmport.server.tools reads
it, streaming a call's arguments as they are written) is also what a template that teaches no format gets,
through a generic system prompt. The others (lmport.tool_parsers.formats) are read when their calls are whole.
"""
from __future__ import annotations

NAMES = ("hermes", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "qwen3_coder", "glm45", "pythonic",
         "harmony")


def for_template(template: str | None) -> str:
    """The format a chat template teaches (hermes when it teaches none of the others)."""
    t = template or ""
    if "<|channel|>" in t and "<|call|>" in t:
        return "harmony"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<arg_key>" in t:
        return "glm45"
    if "<｜tool▁sep｜>" in t:
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "func_name1(" in t:
        return "pythonic"
    if '"parameters": dictionary of argument name' in t or "<|python_tag|>" in t:
        return "llama3_json"
    return "hermes"


def get(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"unknown tool-call parser {name!r}: use one of {', '.join(NAMES)}")
    return name
