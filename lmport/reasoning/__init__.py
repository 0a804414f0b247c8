"""Reasoning: the model's thinking told apart from its answer, by the markers its family writes around it.

A parser is chosen from the chat template (``for_template``) unless the server is told which
(``--reasoning-parser NAME``, or ``none`` for no separation). Each one says, from the rendered prompt, whether
the reply starts inside the thinking (``starts_inside``), splits a reply into (reasoning, answer), whole or as
it streams (``Splitter``), and names the tokens that end the thinking, after which a structured output's
grammar applies (``gate``; lmport.structured_output.grammar).
"""
from __future__ import annotations

from lmport.reasoning.harmony import HarmonyTags
from lmport.reasoning.think import Reasoning, Splitter, ThinkTags

Parser = ThinkTags | HarmonyTags
PARSERS: dict[str, Parser] = {
    # DeepSeek-R1: the template opens the block (``<｜Assistant｜><think>\n``); older R1 releases wrote no
    # opening tag at all, so a reply the prompt says nothing about is thinking until ``</think>``.
    "deepseek_r1": ThinkTags("deepseek_r1", implicit=True),
    # Qwen3: the reply opens the block itself; enable_thinking=false closes an empty one in the prompt.
    "qwen3": ThinkTags("qwen3"),
    # GLM-4.5/4.6: as Qwen3 (enable_thinking=false writes ``<think></think>`` in the prompt).
    "glm45": ThinkTags("glm45"),
    # gpt-oss: the analysis channel of its harmony messages.
    "harmony": HarmonyTags(),
}
NAMES = tuple(PARSERS)


def get(name: str | None) -> Parser | None:
    """The parser called ``name`` (None or "none": no separation); a ValueError naming the choices otherwise."""
    if name is None or name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of {', '.join(NAMES)}, or none")
    return PARSERS[name]


def for_template(template: str | None) -> Parser | None:
    """The parser a chat template's family needs, or None when the template writes no thinking markers."""
    if template and "<|channel|>analysis" in template:
        return PARSERS["harmony"]
    if not template or "</think>" not in template:
        return None
    if "<｜Assistant｜>" in template:
        return PARSERS["deepseek_r1"]
    if "<|assistant|>" in template and "<arg_key>" in template:
        return PARSERS["glm45"]
    return PARSERS["qwen3"]


__all__ = ["NAMES", "PARSERS", "HarmonyTags", "Parser", "Reasoning", "Splitter", "ThinkTags", "for_template", "get"]
