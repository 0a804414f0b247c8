"""What a request's caller reads: its outputs, why it finished, what went wrong, and the refusal of a prompt.

Plain values in a module that imports nothing of the engine, so the HTTP front end (lmport.server,
lmport.engine.client, lmport.engine.messages) reads them without loading the model code.
"""
from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import overload


class _StrEnum(str, enum.Enum):
    """Members that are their strings wherever they go (str(), f-strings, JSON, msgpack): enum.StrEnum, which
    Python 3.10 lacks."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str(self), spec)


class FinishReason(_StrEnum):
    """Why a request ended; each is the string the API and the wire carry."""
    STOP = "stop"        # a stop token, a stop string, a format completed, or an embedding made
    LENGTH = "length"    # max_new_tokens or session_len reached
    ABORT = "abort"      # the caller aborted it
    ERROR = "error"      # it failed: RequestOutput.error says why, RequestOutput.error_kind whose fault it is


class ErrorKind(_StrEnum):
    """Whose fault an error that ended a request is."""
    REQUEST = "request"  # the request's own input (a format that reached a dead end or spent its grammar budget)
    ENGINE = "engine"    # the server's: a forward, sampling or decoding failed, or the model cannot run


@dataclass(frozen=True)
class Failure:
    """The error that ended a request: its message, and whose fault it is."""
    message: str
    kind: ErrorKind = ErrorKind.ENGINE


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the problem and the fix."""


def check_prompt(prompt_ids, vocab: int, session_len: int) -> None:
    """RequestError naming the problem when an engine of this vocabulary and session_len cannot take the prompt."""
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise RequestError("the prompt is empty: give at least one token")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
        raise RequestError(f"prompt token ids must be ints in [0, {vocab})")
    if len(prompt_ids) >= session_len:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens but session_len is {session_len} "
            f"(room for the prompt and at least one generated token): shorten the prompt or raise session_len")


class PackedLogprobs(Sequence[dict[int, float]]):
    """Tokens' logprob entries (each a dict {token id: logprob} of the token and its alternatives) held as flat
    arrays: a token's dict of 21 entries is about 2 KB of Python objects, packed it is 16 bytes an entry. Reading
    an item makes its dict again, its entries in the order they were given; a slice is packed too. What the
    server keeps of a choice's logprobs until its answer is written (32,768 tokens with 20 alternatives each
    held as dicts were about 60 MiB)."""
    __slots__ = ("ids", "values", "ends")

    def __init__(self, entries: Iterable[dict[int, float]] = ()):
        self.ids, self.values, self.ends = array("q"), array("d"), array("q")   # ends: where each token's stop
        self.extend(entries)

    def extend(self, entries: Iterable[dict[int, float]]) -> None:
        for entry in entries:
            self.ids.extend(entry.keys())
            self.values.extend(entry.values())
            self.ends.append(len(self.ids))

    def __len__(self) -> int:
        return len(self.ends)

    @overload
    def __getitem__(self, index: int) -> dict[int, float]: ...

    @overload
    def __getitem__(self, index: slice) -> PackedLogprobs: ...

    def __getitem__(self, index: int | slice) -> dict[int, float] | PackedLogprobs:
        if isinstance(index, slice):
            packed = PackedLogprobs()
            start, stop, step = index.indices(len(self))
            if step != 1:
                packed.extend(self[i] for i in range(start, stop, step))
            elif start < stop:
                first = self.ends[start - 1] if start else 0
                packed.ids, packed.values = self.ids[first:self.ends[stop - 1]], self.values[first:self.ends[stop - 1]]
                packed.ends = array("q", (end - first for end in self.ends[start:stop]))
            return packed
        if not -len(self) <= index < len(self):
            raise IndexError(f"token {index} of {len(self)} tokens' logprobs")
        index %= len(self)
        start, end = self.ends[index - 1] if index else 0, self.ends[index]
        return dict(zip(self.ids[start:end], self.values[start:end]))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None   # type: ignore[assignment]   # mutable, compared by value


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]             # every generated token so far
    text: str                        # the generated text so far
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int = 0
    logprobs: list[dict[int, float]] | PackedLogprobs = field(default_factory=list)
    error: str | None = None
    delta_logprobs: list[dict[int, float]] = field(default_factory=list)   # the logprobs of delta_token_ids
    # gen_config.prompt_logprobs: on the finished output, log p(prompt[i]) with alternatives for i = 1 .. n-1
    prompt_logprobs: list[dict[int, float]] | None = None
    embedding: list[float] | None = None   # an embedding request's pooled hidden state, once done
    error_kind: ErrorKind | None = None    # whose fault ``error`` is

    @property
    def request_fault(self) -> bool:
        """Whether an error ended this request because of its own input (its format), not the server: the
        server answers it as a 400, not a 500."""
        return self.error_kind is ErrorKind.REQUEST
