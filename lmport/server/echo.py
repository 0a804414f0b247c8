"""Completions ``echo``: the prompt's text, and with ``logprobs`` its tokens' log-probabilities, before the completion.

The prompt is scored by the engine as it prefills it (``GenerationConfig.prompt_logprobs``): through the
scheduler like any request, in chunks whose float32 logits stay within the engine's scoring budget, so
running streams go on between chunks, and a client that leaves or a request timeout aborts it at the next
step. OpenAI's shape: the first prompt token has no logprob (``null``).
"""
from __future__ import annotations

from lmport.server.shapes import CompletionLogprobs


def prompt_scores(prompt_ids: list[int], entries: list[dict[int, float]]) -> tuple[list, list]:
    """([None, log p(t_1 | t_0), ...], [None, {token: logprob} at each position]) from the engine's entries."""
    return [None, *(e[t] for e, t in zip(entries, prompt_ids[1:]))], [None, *entries]


def merge(tokenizer, prompt_ids: list[int], prompt_lps: tuple[list, list] | None, top: int | None,
          generated: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """OpenAI's legacy logprobs for prompt + completion: tokens, token_logprobs, top_logprobs, text_offset."""
    if top is None:
        return None
    if prompt_lps is None:
        raise ValueError("merge: the prompt's logprobs are needed when top is given")
    lps, tops = prompt_lps
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    tops_text = [None if e is None else {tokenizer.decode([t]): lp
                                         for t, lp in sorted(e.items(), key=lambda kv: -kv[1])[:top]}
                 for e in tops]
    if generated is None:
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops_text, "text_offset": offsets}
    return {"tokens": tokens + generated["tokens"], "token_logprobs": lps + generated["token_logprobs"],
            "top_logprobs": [*tops_text, *generated["top_logprobs"]],
            "text_offset": offsets + [offset + o for o in generated["text_offset"]]}
