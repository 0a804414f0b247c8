"""Token ids to streamed text: incremental decoding, stop strings, and what may be shown yet.

The engine decodes a sequence's whole output each step and streams the part that
cannot change any more: a trailing partial UTF-8 character is held back until its
bytes complete, and so is text that may yet turn out to start a stop string.
"""
from __future__ import annotations


def decode(tokenizer, output_ids: list[int], *, skip_special_tokens: bool) -> str:
    """The whole generated text so far."""
    return tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)


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
