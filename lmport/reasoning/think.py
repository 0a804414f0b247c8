"""Thinking between ``<think>`` and ``</think>`` (DeepSeek-R1, Qwen3, GLM-4.5): where it starts, where it ends.

The prompt decides where the reply begins. A template that opens the block (``...<think>\\n``) leaves the
reply inside it; one that writes a closed, empty block at its end (Qwen3's and GLM's ``enable_thinking=false``)
leaves it in the answer; otherwise the reply may open the block with its first words, or (DeepSeek-R1's
``implicit`` rule) is thinking until the closing tag. Thinking cut off before its closing tag (the length
limit) stays thinking. The answer is given without the blank lines the model writes after ``</think>``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmport.reasoning.harmony import HarmonySplitter, HarmonyTags


@dataclass(frozen=True)
class ThinkTags:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit: bool = False   # a reply the prompt neither opened nor closed a block for starts inside one
    keeps_special_tokens = False   # the markers are ordinary text in the decoded reply

    def starts_inside(self, prompt: str) -> bool:
        """Whether a reply to the rendered ``prompt`` begins inside the thinking."""
        if prompt.rstrip().endswith(self.end):   # an empty block closed by the template: thinking is off
            return False
        if prompt.rfind(self.start) > prompt.rfind(self.end):   # the template opened a block for the reply
            return True
        return self.implicit

    def splitter(self, inside: bool) -> Splitter:
        return Splitter(self, inside)

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole reply; reasoning None when the reply has none."""
        splitter = Splitter(self, inside)
        reasoning, answer = splitter.feed(text, finished=True)
        return (reasoning if splitter.thought else None), answer

    def gate(self, tokenizer, inside: bool) -> dict:
        """The token ids that end the thinking (a structured output's grammar applies after them), and the one
        token that may open it at the reply's start (None: the marker is several tokens, so it cannot)."""
        start = tokenizer.encode(self.start, add_special_tokens=False)
        return {"end": tokenizer.encode(self.end, add_special_tokens=False), "inside": inside,
                "start": start[0] if len(start) == 1 else None}


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning: its family's markers, and whether its prompt leaves the reply inside them."""
    tags: ThinkTags | HarmonyTags
    inside: bool

    def splitter(self) -> Splitter | HarmonySplitter:
        return self.tags.splitter(self.inside)

    def split(self, text: str) -> tuple[str | None, str]:
        return self.tags.split(text, self.inside)

    def token_count(self, token_ids: list[int], tokenizer) -> int:
        """How many of a reply's tokens are thinking (its markers not counted): each token's text fed to a
        splitter in turn, counted where the splitter reads thinking both before and after it."""
        splitter, count = self.splitter(), 0
        for token in token_ids:
            before = splitter.in_reasoning
            splitter.feed(tokenizer.decode([token], skip_special_tokens=not self.tags.keeps_special_tokens), False)
            count += before and splitter.in_reasoning
        return count

    def gated(self, response_format: dict | None, tokenizer) -> dict | None:
        """``response_format`` applied to the answer only: the grammar starts once the thinking ends."""
        if response_format is None or response_format.get("type") == "text":
            return response_format
        return {**response_format, "reasoning": self.tags.gate(tokenizer, self.inside)}


class Splitter:
    """One reply's text, fed as it streams, split into reasoning and answer pieces.

    Text that may be the start of a marker is held back until it is known, so that no piece carries part of
    a tag; the pieces concatenate to ``ThinkTags.split`` of the whole text.
    """

    def __init__(self, tags: ThinkTags, inside: bool):
        self.tags = tags
        self.state = "reasoning" if inside else "start"   # start: the reply may open a block with its first words
        self.buffer = ""
        self.fresh = inside     # nothing read yet inside the block: a repeated opening tag is dropped
        self.thought = inside   # whether the reply had a thinking block at all
        self.trim = False       # just past the closing tag: the answer's leading blank lines are dropped

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning, answer) pieces that ``delta`` completes; ``finished``: nothing more comes."""
        self.buffer += delta
        reasoning = answer = ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(self.tags.start):
                self.buffer = head[len(self.tags.start):]
                self.state, self.thought = "reasoning", True
            elif not finished and (not head or self.tags.start.startswith(head)):
                return "", ""
            else:
                self.state = "answer"
        if self.state == "reasoning":
            if self.fresh:
                head = self.buffer.lstrip()
                if not finished and self.tags.start.startswith(head) and head != self.tags.start:
                    return "", ""
                if head.startswith(self.tags.start):
                    self.buffer = head[len(self.tags.start):]
                self.fresh = False
            end = self.buffer.find(self.tags.end)
            if end < 0:
                keep = 0 if finished else _partial_suffix(self.buffer, self.tags.end)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(self.tags.end):]
            self.state, self.trim = "answer", True
        if self.trim:
            self.buffer = self.buffer.lstrip()
            if not self.buffer and not finished:
                return reasoning, ""
            self.trim = False
        answer, self.buffer = self.buffer, ""
        return reasoning, answer


def _partial_suffix(text: str, word: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``word``."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0
