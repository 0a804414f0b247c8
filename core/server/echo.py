"""Completions ``echo``: the prompt's text, and with ``logprobs`` its tokens' log-probabilities, before the completion.

The prompt is scored through the engine's paged KV cache, as lmport.scoring does for ``Pipeline.get_ppl``,
but one chunk of at most ``chunk_tokens()`` positions at a time, each chunk on the engine thread between
steps: running streams go on between chunks, a client that leaves or a request timeout stops the scoring
at the next chunk, and a chunk's float32 logits stay within ``LOGITS_BUDGET`` (the log-softmax is taken
row by row through logsumexp, never as a second [positions x vocab] array). OpenAI's shape: the first
prompt token has no logprob (``null``).
"""
from __future__ import annotations

import time

import torch

from lmport.config import GenerationConfig
from lmport.engine import Engine, RequestError
from lmport.runner import StepInput
from lmport.sequence import Sequence
from lmport.server.protocol import APIError

LOGITS_BUDGET = 64 * 2**20   # bytes of float32 logits one scoring chunk may hold
MAX_CHUNK = 512              # positions a chunk may score (a step's worth of prefill, at most)


def chunk_tokens(vocab_size: int, max_prefill: int) -> int:
    return max(1, min(LOGITS_BUDGET // (4 * vocab_size), MAX_CHUNK, max_prefill))


class Scorer:
    """log p(ids[i] | ids[:i]) for i = 1 .. n-1 and each position's ``top`` most likely tokens, a chunk a call.

    Every method runs on the engine thread (EngineLoop.run). ``close()`` frees the KV blocks; a chunk after
    it does nothing.
    """

    def __init__(self, ids: list[int], top: int, chunk: int):
        self.ids, self.top, self.chunk = ids, top, chunk
        self.seq = Sequence(f"score-{id(self)}", ids, GenerationConfig())
        self.logprobs: list[float] = []
        self.tops: list[dict[int, float]] = []
        self.start = 0
        self.closed = False

    @property
    def done(self) -> bool:
        return self.start >= len(self.ids) - 1

    def step(self, engine: Engine) -> None:
        if self.closed or self.done:
            return
        blocks, ids, start = engine.block_manager, self.ids, self.start
        n = min(self.chunk, len(ids) - 1 - start)
        if not blocks.can_allocate(self.seq, n):
            raise RequestError(f"not enough free KV blocks to score {len(ids)} tokens; retry when running "
                               f"requests have finished")
        blocks.allocate(self.seq, n)
        logits = engine.executor.execute(StepInput(
            ids[start:start + n], [n], [start + n], [self.seq.block_table], list(range(n)), blocks.take_copies()))
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1)                     # [n]: no second [n, vocab] array
        targets = torch.tensor(ids[start + 1:start + n + 1], device=logits.device)
        self.logprobs += (logits.gather(1, targets[:, None])[:, 0] - lse).tolist()
        if self.top:
            best = logits.topk(self.top, dim=-1)
            values = (best.values - lse[:, None]).tolist()
            self.tops += [dict(zip(i, v)) for i, v in zip(best.indices.tolist(), values)]
        del logits
        self.seq.num_computed += n
        self.start += n

    def close(self, engine: Engine) -> None:
        if not self.closed:
            self.closed = True
            engine.block_manager.free(self.seq)


async def prompt_logprobs(server, ids: list[int], top: int, deadline: float | None = None
                          ) -> tuple[list[float | None], list[dict | None]]:
    """[None, log p(t_1 | t_0), ...] and the top-``top`` alternatives at each position (None first).

    ``deadline`` (time.perf_counter()) ends the scoring with a 504 at the next chunk; cancelling the caller
    (a client that left) stops it there too. Either way its KV blocks are freed.
    """
    if not server.loop.scores_prompts:
        raise APIError(400, "logprobs with echo scores the prompt on one engine, which a server of data-parallel "
                            "replicas (--dp > 1) does not have: leave logprobs or echo out", param="logprobs")
    if len(ids) < 2:
        return [None], [None]
    engine = server.engine
    scorer = Scorer(ids, top, chunk_tokens(engine.model_config.vocab_size, engine.config.max_prefill_token_num))
    try:
        while not scorer.done:
            if deadline is not None and time.perf_counter() > deadline:
                raise APIError(504, "the request did not finish within the server's timeout (--request-timeout) "
                                    "while scoring the prompt, and was aborted", type="server_error", code="timeout")
            await server.loop.run(scorer.step)
    except RequestError as exc:   # no free KV blocks right now
        raise APIError(503, f"prompt: cannot score it now: {exc}", param="prompt", type="server_error") from None
    finally:
        server.loop.submit(scorer.close)   # after any chunk still queued; never waits
    lps, tops = scorer.logprobs, scorer.tops
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
