"""Prompt scoring: each token's log-likelihood under the model, through the engine's paged KV cache.

Shared by ``Pipeline.get_ppl`` / ``Pipeline.get_logprobs`` and the server's completions ``echo``, so
the numbers the API reports are the pipeline's.
"""
from __future__ import annotations

import torch

from lmport.config import GenerationConfig
from lmport.engine import Engine, RequestError
from lmport.runner import StepInput
from lmport.sequence import Sequence
from lmport.units import GiB


# get_ppl keeps each chunk's float32 logits under this (LMDeploy's limit too).
PPL_LOGITS_BUDGET = 2 * GiB


def logits_chunk_tokens(vocab_size: int, budget_bytes: int = PPL_LOGITS_BUDGET) -> int:
    """Positions a chunk may score so that its [positions, vocab] float32 logits stay within the budget."""
    positions = budget_bytes // (vocab_size * 4)
    if positions < 1:
        raise ValueError(f"a logits budget of {budget_bytes} bytes is less than one position "
                         f"({vocab_size} x 4 bytes)")
    return positions


def chunk_tokens(engine: Engine, logits_budget_bytes: int = PPL_LOGITS_BUDGET) -> int:
    """Positions a chunk may hold so its float32 logits stay under the budget (and within max_prefill_token_num)."""
    return min(logits_chunk_tokens(engine.model_config.vocab_size, logits_budget_bytes),
               engine.config.max_prefill_token_num)


def token_logprobs(engine: Engine, ids: list[int], chunk: int, top: int = 0
                   ) -> tuple[list[float], list[dict[int, float]]]:
    """log p(ids[i] | ids[:i]) for i = 1 .. n-1, and each position's ``top`` most likely tokens.

    The input is prefilled in chunks of at most ``chunk`` positions, so a chunk's float32 logits
    never exceed the budget chunk_tokens() was given. Its blocks are freed before returning.
    """
    blocks = engine.block_manager
    vocab = engine.model_config.vocab_size
    if len(ids) < 2 or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
        raise RequestError(f"scoring needs at least 2 token ids, each an int in [0, {vocab})")
    if len(ids) > engine.session_len:
        raise RequestError(f"{len(ids)} tokens exceed session_len {engine.session_len}")
    seq = Sequence(f"score-{id(ids)}", ids, GenerationConfig())
    logprobs: list[float] = []
    tops: list[dict[int, float]] = []
    try:
        # The last token predicts nothing: positions 0 .. n-2 are scored against ids 1 .. n-1.
        for start in range(0, len(ids) - 1, chunk):
            n = min(chunk, len(ids) - 1 - start)
            if not blocks.can_allocate(seq, n):
                raise RequestError(f"not enough free KV blocks to score {len(ids)} tokens; "
                                   f"retry when running requests have finished")
            blocks.allocate(seq, n)
            # Evicted cached blocks go to the host tier (the copies run first) before we overwrite them.
            logits = engine.executor.execute(StepInput(
                ids[start:start + n], [n], [start + n], [seq.block_table], list(range(n)), blocks.take_copies()))
            lp = logits.log_softmax(-1)       # [n, vocab] float32: within the budget
            targets = torch.tensor(ids[start + 1:start + n + 1]).to(lp.device)
            logprobs += lp.gather(1, targets[:, None])[:, 0].tolist()
            if top:
                best = lp.topk(top, dim=-1)
                tops += [dict(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
            seq.num_computed += n
    finally:
        blocks.free(seq)
    return logprobs, tops
