"""Prompt scoring: each token's log-likelihood under the model, through the engine's paged KV cache.

``Pipeline.get_ppl`` / ``Pipeline.get_logprobs`` score a prompt as the server's completions ``echo`` does: a
request with ``GenerationConfig.prompt_logprobs`` that the scheduler runs like any other, so the numbers the
API reports are the server's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lmport.config import GenerationConfig
from lmport.engine.outputs import RequestError
from lmport.units import GiB

if TYPE_CHECKING:
    from lmport.engine.core import EngineCore
    from lmport.engine.llm import LLM

    Engine = EngineCore | LLM


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
    """log p(ids[i] | ids[:i]) for i = 1 .. n-1, and at each position the ``top`` most likely tokens with the
    scored one.

    A request like any other (gen_config.prompt_logprobs, nothing generated): the scheduler prefills it in
    chunks of at most ``chunk`` positions, so a chunk's float32 logits never exceed the budget chunk_tokens()
    was given, and its blocks are freed when it ends. It steps the engine until then: call it with no other
    request in flight, whose outputs it would not return.
    """
    vocab = engine.model_config.vocab_size
    if len(ids) < 2 or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
        raise RequestError(f"scoring needs at least 2 token ids, each an int in [0, {vocab})")
    if len(ids) > engine.session_len:
        raise RequestError(f"{len(ids)} tokens exceed session_len {engine.session_len}")
    request_id = engine.add_request(ids, GenerationConfig(max_new_tokens=0, prompt_logprobs=top),
                                    scoring_chunk=chunk)
    out = None
    try:
        while out is None:
            out = next((o for o in engine.step() if o.request_id == request_id and o.finished), None)
    finally:
        if out is None:   # interrupted: its blocks are freed now
            engine.abort(request_id)
    if out.error is not None:
        raise RuntimeError(out.error)
    entries = out.prompt_logprobs or []
    return [entry[t] for t, entry in zip(ids[1:], entries)], entries if top else []
