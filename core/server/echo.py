"""Completions ``echo``: the prompt's text, and with ``logprobs`` its tokens' log-probabilities, before the completion.

The prompt is scored by lmport.scoring (the same code as ``Pipeline.get_ppl``) on the engine's
thread between steps. OpenAI's shape: the first prompt token has no logprob (``null``).
"""
from __future__ import annotations

import asyncio

from lmport import scoring
from lmport.engine import Engine, RequestError
from lmport.server.protocol import APIError


async def prompt_logprobs(server, ids: list[int], top: int) -> tuple[list[float | None], list[dict | None]]:
    """[None, log p(t_1 | t_0), ...] and the top-``top`` alternatives at each position (None first)."""
    if len(ids) < 2:
        return [None], [None]

    def score(engine: Engine):
        return scoring.token_logprobs(engine, ids, scoring.chunk_tokens(engine), top)
    try:
        lps, tops = await asyncio.to_thread(server.loop.call, score)
    except RequestError as exc:   # no free KV blocks right now
        raise APIError(503, f"prompt: cannot score it now: {exc}", param="prompt", type="server_error") from None
    # OpenAI lists the chosen token among the top ones.
    return [None, *lps], [None, *({t: lp, **top_} for t, lp, top_ in zip(ids[1:], lps, tops or [{}] * len(lps)))]


def merge(server, prompt_ids: list[int], prompt_lps: tuple[list, list] | None, top: int | None,
          generated: dict | None) -> dict | None:
    """OpenAI's legacy logprobs for prompt + completion: tokens, token_logprobs, top_logprobs, text_offset."""
    if top is None:
        return None
    if prompt_lps is None:
        raise ValueError("merge: the prompt's logprobs are needed when top is given")
    lps, tops = prompt_lps
    tokens = [server.token_text(t) for t in prompt_ids]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    tops_text = [None if e is None else {server.token_text(t): lp
                                         for t, lp in sorted(e.items(), key=lambda kv: -kv[1])[:top]}
                 for e in tops]
    if generated is None:
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops_text, "text_offset": offsets}
    return {"tokens": tokens + generated["tokens"], "token_logprobs": lps + generated["token_logprobs"],
            "top_logprobs": tops_text + generated["top_logprobs"],
            "text_offset": offsets + [offset + o for o in generated["text_offset"]]}
