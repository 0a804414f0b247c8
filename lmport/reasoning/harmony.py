"""gpt-oss's harmony format: a reply is a run of messages, each a header and a body on a channel.

After the template's ``<|start|>assistant``, the model writes for instance::

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

or, to call a tool, a commentary message addressed to it (the recipient before or after the channel)::

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The analysis channel is the reasoning; the final channel (and commentary to no one) is the answer; a call is
passed on in the answer as ``<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>``, which the
``harmony`` tool-call format reads (lmport.tool_parsers.formats.Harmony). The markers are special tokens, so a
reply is decoded with them kept (``keeps_special_tokens``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|return|>", "<|call|>")
CALL_MARK = "<|channel|>commentary to=functions."
RECIPIENT = re.compile(r"to=(functions\.[^\s<]+)")
CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
TRAILING_MARKER = re.compile(r"<\|[^|<>\s]*\|>$")


@dataclass(frozen=True)
class HarmonyTags:
    name: str = "harmony"
    keeps_special_tokens: bool = True
    final: str = "<|channel|>final<|message|>"

    def starts_inside(self, prompt: str) -> bool:
        return True   # the reply begins with a message's header, which says its channel

    def splitter(self, inside: bool) -> HarmonySplitter:
        return HarmonySplitter()

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        splitter = HarmonySplitter()
        reasoning, answer = splitter.feed(text, finished=True)
        return (reasoning if splitter.thought else None), answer

    def gate(self, tokenizer, inside: bool) -> dict:
        """A structured output constrains the final channel's text: it applies once its header is written."""
        return {"end": tokenizer.encode(self.final, add_special_tokens=False), "inside": True, "start": None}


class HarmonySplitter:
    """One reply's text, fed as it streams, split into reasoning (analysis) and answer (final, calls) pieces."""

    def __init__(self):
        self.buffer = ""
        self.body: str | None = None   # in a message's body: its route ("reasoning", "answer" or "call")
        self.thought = False

    @property
    def in_reasoning(self) -> bool:
        return self.body == "reasoning"

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.buffer += delta
        reasoning = answer = ""
        while True:
            if self.body is None:
                at = self.buffer.find(MESSAGE)
                if at < 0:
                    if finished:   # a header with no body (the end token's text) carries nothing; text
                        plain = TRAILING_MARKER.sub("", self.buffer)   # with no markers (but the end
                        if "<|" not in plain:                          # token's) is the answer as it is
                            answer += plain
                        self.buffer = ""
                    return reasoning, answer
                header, self.buffer = self.buffer[:at], self.buffer[at + len(MESSAGE):]
                channel = CHANNEL.search(header)
                recipient = RECIPIENT.search(header)
                if recipient:
                    self.body = "call"
                    answer += f"{CALL_MARK}{recipient[1][len('functions.'):]}{MESSAGE}"
                elif channel and channel[1] == "analysis":
                    self.body, self.thought = "reasoning", True
                else:
                    self.body = "answer"
            ends = [(i, end) for end in ENDS if (i := self.buffer.find(end)) >= 0]
            if ends:
                at, end = min(ends)
                text, self.buffer = self.buffer[:at], self.buffer[at + len(end):]
            else:
                keep = 0 if finished else max(_partial_suffix(self.buffer, end) for end in ENDS)
                text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            if self.body == "reasoning":
                reasoning += text
            else:
                answer += text
            if not ends:
                if self.body == "call" and finished:
                    answer += "<|call|>"   # cut off: the tool-call format decides whether it is a call
                return reasoning, answer
            if self.body == "call":
                answer += "<|call|>"
            self.body = None


def _partial_suffix(text: str, word: str) -> int:
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0
