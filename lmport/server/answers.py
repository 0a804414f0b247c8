"""Whole (non-streamed) answers: bounded in size before anything is generated, then built and serialised in a
worker thread, so that a big answer never stops the event loop (/health, other clients' streams).

A 48 MB answer (n=16 x 2048 tokens with 20 top logprobs each) built and serialised on the event loop held it for
23 s. In a worker thread, building it and serialising it (json's C encoder) give the loop its turn every few
milliseconds (measured: the loop waits at most tens of milliseconds while a 28 MB answer is serialised).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from fastapi.responses import Response

from lmport.server.frontend import Frontend, Job
from lmport.server.protocol import APIError

# What FastAPI's JSONResponse writes: compact, UTF-8, and no NaN or Infinity (not JSON).
encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


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


async def json_response(build: Callable[[], dict]) -> Response:
    """The answer ``build()`` makes, built and serialised in a worker thread."""
    content = await asyncio.to_thread(lambda: encode(build()).encode())
    return Response(content, media_type="application/json")
