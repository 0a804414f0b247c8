"""Whole (non-streamed) answers: bounded in size before anything is generated, then built and serialised in a
worker thread, so that a big answer never stops the event loop (/health, other clients' streams).

A 48 MB answer (n=16 x 2048 tokens with 20 top logprobs each) built and serialised on the event loop held it for
23 s. A worker thread alone is not enough: json's C encoder holds the GIL for the whole of one call, so an answer
encoded in one call holds the loop for as long as that takes (seconds). ``pieces`` encodes an answer in pieces
of about ``PIECE`` characters (a choice at a time, a long list in slices), and the loop gets the GIL between them.
An answer's choices are ``Each``: each choice is made as it is written and dropped once written, so a whole
answer is never held as Python objects (a dict per token and alternative) all at once, only as its JSON text.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar, overload

from fastapi.responses import Response

from lmport.server.frontend import Frontend, Job
from lmport.server.protocol import APIError

T = TypeVar("T")


class Each(Sequence[T]):
    """A JSON array whose items are made when they are read (``make(index)``): ``pieces`` reads it a slice at a
    time and drops each slice once it is written, so its items are never all held at once."""
    __slots__ = ("size", "make")

    def __init__(self, size: int, make: Callable[[int], T]):
        self.size, self.make = size, make

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self.make(i) for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(f"Each: index {index} out of range for {self.size} items")
        return self.make(index % self.size)


def _listed(value) -> list:
    """An ``Each`` the encoder meets inside a value it writes whole, as the list it stands for."""
    if isinstance(value, Each):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# What FastAPI's JSONResponse writes: compact, UTF-8, and no NaN or Infinity (not JSON).
encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_listed).encode

# Characters of JSON text one call of the C encoder writes at most (about, for a list's slices): a few milliseconds
# of holding the GIL.
PIECE = 1 << 16
OPENED_DEPTH = 16   # levels of nesting ``pieces`` opens; deeper values are encoded whole


def entries(frontend: Frontend, job: Job) -> int:
    """The most token entries the job's answer can hold: each choice's tokens (no more than its session leaves),
    plus its prompt when scored (echo), each with its top logprobs."""
    total = 0
    for choice, config in enumerate(job.configs):
        prompt = len(job.prompt_of(choice))
        total += min(config.max_new_tokens, max(frontend.info.session_len - prompt, 0)) * (1 + (config.logprobs or 0))
        if config.prompt_logprobs is not None:
            total += prompt * (1 + config.prompt_logprobs)
    return total


def check_size(frontend: Frontend, job: Job) -> None:
    """A 400 naming the limit when the job's whole answer could hold more than ``max_answer_entries``."""
    limit = frontend.limits.max_answer_entries
    if (most := entries(frontend, job)) > limit:
        config = job.configs[0]
        raise APIError(400, f"max_tokens: a whole answer of up to {most} token entries (choices x max_tokens x "
                            f"(1 + top logprobs): {len(job.configs)} x {config.max_new_tokens} x "
                            f"{1 + (config.logprobs or 0)}) is more than the server's limit of {limit} "
                            f"(--max-answer-entries); send stream=true to get it in pieces, or ask for fewer "
                            f"tokens, choices or logprobs", param="max_tokens", code="answer_too_large")


def pieces(value, depth: int = 0) -> Iterator[str]:
    """``value``'s JSON text, exactly as ``encode(value)`` writes it, in pieces: containers are opened here and
    a list's items encoded in slices sized from the slice before (an item bigger than a piece is opened in
    turn), so no one call of the C encoder writes much more than ``PIECE`` characters, unless one string is
    longer. Below ``OPENED_DEPTH`` levels a value is encoded whole (a deeply nested one, such as a tool call's
    generated arguments, is small, and the encoder keeps its own recursion limit)."""
    if depth >= OPENED_DEPTH:
        yield encode(value)
    elif isinstance(value, dict) and value and all(isinstance(key, str) for key in value):
        separator = "{"
        for key, item in value.items():
            yield separator + encode(key) + ":"
            yield from pieces(item, depth + 1)
            separator = ","
        yield "}"
    elif isinstance(value, (list, Each)) and value:
        yield "["
        start, step = 0, 0   # step 0: open the next item; more: the next slice's length
        while start < len(value):
            separator = "," if start else ""
            if step == 0:
                yield separator
                size, done = len(separator), 1
                for piece in pieces(value[start], depth + 1):
                    size += len(piece)
                    yield piece
            else:
                text = separator + encode(value[start:start + step])[1:-1]
                yield text
                size, done = len(text), min(step, len(value) - start)
            start += done
            fits = PIECE * done // max(size, 1)   # items the size of these that fill a piece
            step = min(fits, 2 * done)            # growing slowly, in case later items are bigger
        yield "]"
    else:   # a scalar, an empty list, dict or Each, or a dict with keys json converts
        yield encode(value)


def joined(value) -> memoryview:
    """``value``'s JSON text in UTF-8, encoded in pieces (``pieces``) into one buffer (its bytes are held once,
    never once in pieces and again joined)."""
    text, held, size = bytearray(), [], 0
    for piece in pieces(value):
        held.append(piece)
        size += len(piece)
        if size >= PIECE:   # UTF-8 a piece at a time too: one call for the whole answer holds the GIL as long
            text += "".join(held).encode()
            held, size = [], 0
    text += "".join(held).encode()
    return memoryview(text)


# Bytes of a whole answer handed to the HTTP server at a time.
SEND_SLICE = 1 << 20


class SlicedResponse(Response):
    """A response whose body goes to the HTTP server a slice of ``SEND_SLICE`` bytes at a time, waiting for the
    client to take each: given whole, the server copies it (h11 joins what it sends into new bytes) and the
    transport keeps what the socket has not taken yet, so a 46 MB answer was held three times over until the
    client had read it; in slices it is held once, plus a slice. The headers (Content-Length among them) are
    the same."""

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = memoryview(self.body)
        for start in range(0, len(body), SEND_SLICE):
            await send({"type": "http.response.body", "body": body[start:start + SEND_SLICE], "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        if self.background is not None:
            await self.background()


async def json_response(build: Callable[[], Mapping[str, object]]) -> Response:
    """The answer ``build()`` makes, built and serialised in a worker thread, in pieces (``pieces``), and sent in
    slices (``SlicedResponse``)."""
    content = await asyncio.to_thread(lambda: joined(build()))
    return SlicedResponse(content, media_type="application/json")
