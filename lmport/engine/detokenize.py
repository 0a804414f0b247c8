"""Token ids to streamed text: incremental decoding, stop strings, and what may be shown yet.

Each step the engine decodes a sequence's new tokens (``IncrementalDecoder``) and streams the
part that cannot change any more: a trailing partial UTF-8 character is held back until its
bytes complete, and so is text that may yet turn out to start a stop string. A finished
sequence's text is its whole output decoded at once.
"""
from __future__ import annotations


def decode(tokenizer, output_ids: list[int], *, skip_special_tokens: bool) -> str:
    """The whole generated text so far."""
    return tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """A sequence's output text, kept up to date by decoding only the tokens since its last
    complete character, with the tokens decoded the time before as context (as vLLM and SGLang
    do). Decoding the whole output each step would cost time linear in its length.

    The context is decoded again with the new tokens, and only what the new tokens add is kept,
    so a token a tokenizer renders differently at the start of a text (dropping its leading space)
    is rendered as in the whole output. Where the new tokens change the context's text (a
    tokenizer that cleans up spaces before punctuation), the whole output is decoded instead.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.text = ""     # the text of output_ids[:read]
        self.context = 0   # output_ids[context:read] are decoded again before the new tokens
        self.read = 0

    def update(self, output_ids: list[int]) -> str:
        """The text of ``output_ids`` (the last call's plus new ones) up to its last complete character."""
        before, window = self._decode(output_ids[self.context:self.read]), self._decode(output_ids[self.context:])
        if window.endswith("\ufffd"):     # a character's bytes still incomplete: wait for the rest
            return self.text
        if window.startswith(before):
            self.text += window[len(before):]
        else:
            self.text = self._decode(output_ids).rstrip("\ufffd")
        self.context, self.read = self.read, len(output_ids)
        return self.text

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, skip_special_tokens=self.skip_special_tokens)


def final_delta(text: str, old_text: str) -> str:
    """The last piece of a finished sequence's text (its stop string cut off already)."""
    return text[len(old_text):] if text.startswith(old_text) else ""


def streamable_delta(text: str, old_text: str, stop_words: list[str] | None) -> str:
    """The new text that can be shown now, after ``old_text`` (which was shown)."""
    # Hold back a trailing partial UTF-8 character until its bytes complete.
    shown = text.rstrip("\ufffd")
    if stop_words:  # and text that may yet turn out to start a stop string
        shown = shown[:len(shown) - stop_prefix_len(shown, stop_words)]
    return shown[len(old_text):] if len(shown) > len(old_text) else ""


def first_stop(text: str, stop_words: list[str], searched: int) -> int | None:
    """Index of the earliest stop string in ``text`` that ends after ``searched`` chars."""
    start = max(0, searched - max(len(s) for s in stop_words))
    hits = [i for s in stop_words if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def stop_prefix_len(text: str, stop_words: list[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string (and so may become one)."""
    best = 0
    for word in stop_words:
        for n in range(min(len(word) - 1, len(text)), best, -1):
            if text.endswith(word[:n]):
                best = n
                break
    return best
