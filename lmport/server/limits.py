"""Bounded work: what one HTTP request may ask for, and how many engine requests the server admits.

Each choice of each prompt is one engine request. ``Admission`` counts the
engine requests that are running or waiting; beyond ``capacity``
(max_batch_size + max_waiting_requests) a new HTTP request gets 503 with
``Retry-After`` instead of joining an ever longer queue. The event loop is
the only caller, so plain integers suffice.
"""
from __future__ import annotations

from dataclasses import dataclass

from lmport.config import ConfigError
from lmport.server.protocol import APIError

PROMPT_CHARS_PER_TOKEN = 16   # a prompt longer than this many characters a token of session_len cannot fit
RETRY_AFTER_SECONDS = 1
# Token entries (a token, or one of its top logprobs) a whole, non-streamed answer may hold: with logprobs about
# 70 bytes of JSON each, so about 70 MiB; n=16 x max_tokens=2048 x (1 + top_logprobs=20) is 688128.
MAX_ANSWER_ENTRIES = 2**20


@dataclass
class Limits:
    max_engine_requests: int = 256          # per HTTP request: prompts x n
    max_answer_entries: int = MAX_ANSWER_ENTRIES   # per non-streamed answer: choices x tokens x (1 + top logprobs)
    max_prompt_chars: int | None = None     # per prompt, before tokenizing; None: 16 x session_len
    max_waiting_requests: int | None = None  # engine requests queued beyond the running batch; None: 4 x batch
    request_timeout: float | None = None     # seconds from arrival to the last token; None: no deadline
    body_timeout: float = 30.0               # seconds to receive the whole request body
    send_timeout: float = 30.0               # seconds one write to a client that does not read may wait
    engine_stall_timeout: float = 10.0       # seconds the core may send nothing with requests pending: /health 503

    def __post_init__(self):
        def positive(name, value, kind=int):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or (kind is int and not isinstance(value, int)) or value <= 0):
                raise ConfigError(f"{name} must be a positive {kind.__name__}, got {value!r}")
        positive("max_engine_requests", self.max_engine_requests)
        positive("max_answer_entries", self.max_answer_entries)
        positive("max_prompt_chars", self.max_prompt_chars)
        positive("request_timeout", self.request_timeout, float)
        positive("body_timeout", self.body_timeout, float)
        positive("send_timeout", self.send_timeout, float)
        positive("engine_stall_timeout", self.engine_stall_timeout, float)
        if self.max_waiting_requests is not None and (not isinstance(self.max_waiting_requests, int)
                                                      or self.max_waiting_requests < 0):
            raise ConfigError(f"max_waiting_requests must be an int >= 0, got {self.max_waiting_requests!r}")

    def prompt_chars(self, session_len: int) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * session_len

    def waiting(self, max_batch_size: int) -> int:
        return 4 * max_batch_size if self.max_waiting_requests is None else self.max_waiting_requests


class Admission:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.active = 0          # engine requests admitted and not yet finished
        self.closed: str | None = None   # why nothing more is admitted (shutting down)

    def admit(self, count: int):
        """Admit ``count`` engine requests, or raise a 400/503 APIError; returns the (idempotent) release."""
        if self.closed:
            raise APIError(503, self.closed, type="server_error", code="unavailable")
        if count > self.capacity:
            raise APIError(400, f"this request needs {count} engine requests (prompts x n) but the server runs "
                                f"or queues at most {self.capacity} at once: send fewer prompts or a smaller n")
        if self.active + count > self.capacity:
            raise APIError(503, f"the server is busy ({self.active} of {self.capacity} engine requests running "
                                f"or waiting); retry after {RETRY_AFTER_SECONDS} s", type="server_error",
                           code="server_busy", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self.active += count
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                self.active -= count
        return release
