"""Batched sampling: greedy, temperature, top-k, top-p, min-p, repetition, presence and frequency
penalties, logit bias, token masks of structured outputs, seeds, logprobs.

Numerically safe for any valid GenerationConfig: temperatures below TEMPERATURE_FLOOR act
as greedy, filtered rows are renormalised in float32, and a row left with no finite
probability (NaN or -inf logits) falls back to the greedy choice instead of raising.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from lmport.structured_output.grammar import apply_bitmask
from lmport.sched.sequence import Sequence

# Dividing logits by a smaller temperature overflows float32; so close to 0 sampling is greedy anyway.
TEMPERATURE_FLOOR = 1e-5
# Most likely tokens top-p is first looked for in (a partial sort); a row whose top_p needs more sorts all.
CANDIDATES = 1024
# Tokens a chunk when drawing (draw()): a chunk wins a race among chunks, then a token one within it.
DRAW_CHUNK = 1024


def apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """transformers' rule: a seen token's logit is divided by the penalty if positive, else multiplied."""
    rows = [i for i, s in enumerate(seqs) if s.gen_config.repetition_penalty != 1.0]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        seen = torch.tensor(sorted(set(seqs[i].token_ids)), device=logits.device)
        penalty = seqs[i].gen_config.repetition_penalty
        values = logits[i, seen]
        logits[i, seen] = torch.where(values > 0, values / penalty, values * penalty)
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's logit gets its bias added (-100 bans it, 100 forces it)."""
    rows = [i for i, s in enumerate(seqs) if s.gen_config.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        bias = seqs[i].gen_config.logit_bias or {}
        logits[i, torch.tensor(list(bias), device=logits.device)] += torch.tensor(
            list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def apply_presence_frequency_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI's rule over generated tokens: logit -= count * frequency_penalty + (count > 0) * presence_penalty."""
    rows = [i for i, s in enumerate(seqs)
            if (s.gen_config.presence_penalty or s.gen_config.frequency_penalty) and s.output_ids]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    longest = max(len(seqs[i].output_ids) for i in rows)
    # Output ids padded with an extra column (vocab) that is dropped after counting.
    ids = torch.full((len(rows), longest), vocab, dtype=torch.long)
    for j, i in enumerate(rows):
        ids[j, :len(seqs[i].output_ids)] = torch.tensor(seqs[i].output_ids)
    ids = ids.to(dev)
    counts = torch.zeros(len(rows), vocab + 1, device=dev).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float))
    counts = counts[:, :vocab]
    freq = torch.tensor([seqs[i].gen_config.frequency_penalty for i in rows], device=dev)[:, None]
    presence = torch.tensor([seqs[i].gen_config.presence_penalty for i in rows], device=dev)[:, None]
    logits = logits.clone()
    logits[rows] -= counts * freq + (counts > 0).float() * presence
    return logits


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p remove; rows with k=0, p=1, min_p=0 are untouched.

    In the order transformers, vLLM, LMDeploy and llama.cpp apply them: top-p's mass is measured over the
    tokens top-k keeps (renormalised), min-p against the most likely token. Only the rows that filter are
    filtered, and over their most likely tokens (a partial sort) where those hold every token a row can keep."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    rows = ((k < vocab) | (top_p < 1) | (min_p > 0)).nonzero()[:, 0]
    if not len(rows):
        return logits
    every_row = len(rows) == len(logits)
    x = logits if every_row else logits[rows]
    k, top_p, min_p = k[rows], top_p[rows], min_p[rows]
    # top-p's whole: the mass of the row's top k (of every token where k is the vocabulary).
    log_total = x.logsumexp(-1, keepdim=True)
    if (k_width := int(torch.where((top_p < 1) & (k < vocab), k, 0).max())) > 0:
        past_k = torch.arange(k_width, device=x.device) >= k[:, None]
        in_k = x.topk(k_width, dim=-1).values.masked_fill(past_k, float("-inf"))
        log_total = torch.where((k < vocab)[:, None], in_k.logsumexp(-1, keepdim=True), log_total)
    # The tokens a row can keep are within its top k and within those min-p keeps; top-p is first looked for
    # within the top CANDIDATES, and past them (a sort of the whole vocabulary) only if they hold too little.
    # (min-p's count a little wide: the rule below compares probabilities, rounded otherwise.)
    keeps = k
    if bool((min_p > 0).any()):
        keeps = torch.minimum(k, (x >= x.max(-1, keepdim=True).values + min_p[:, None].log() - 1e-3).sum(-1))
    width = int(torch.where(top_p < 1, keeps.clamp(max=CANDIDATES), keeps).max())
    top, order = x.topk(width, dim=-1) if width < vocab else x.sort(dim=-1, descending=True)
    probs = (top - log_total).exp()
    mass = probs.cumsum(-1)
    if width < vocab and bool(((keeps > width) & (mass[:, -1] < top_p)).any()):
        top, order = x.sort(dim=-1, descending=True)
        probs = (top - log_total).exp()
        mass = probs.cumsum(-1)
    ranks = torch.arange(top.shape[-1], device=x.device)
    remove = ranks[None, :] >= k[:, None]
    # Keep the smallest prefix whose mass reaches top_p (always at least one token); at top_p 1, every token
    # (float32 sums reach 1 before the tail).
    remove |= ((mass - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    filtered = torch.full_like(x, float("-inf")).scatter_(-1, order, top.masked_fill(remove, float("-inf")))
    if every_row:
        return filtered
    out = logits.clone()
    out[rows] = filtered
    return out


def samples(seq: Sequence) -> bool:
    """Whether ``seq`` draws its tokens (else it takes the greedy one)."""
    cfg = seq.gen_config
    return not cfg.greedy and cfg.temperature >= TEMPERATURE_FLOOR


def adjusted_logits(logits: torch.Tensor, seqs: list[Sequence],
                    masks: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """float32 logits after logit bias, structured-output masks and the penalties: the greedy choice is
    greedy_tokens() of them, and sampling_probs() turns them into the distribution a token is drawn from.
    A NaN stays (the adjustments keep it NaN): both read it as -inf, "never this token"."""
    logits = apply_logit_bias(logits.float(), seqs)
    if masks is not None:
        logits = apply_bitmask(logits, *masks)
    logits = apply_repetition_penalty(logits, seqs)
    return apply_presence_frequency_penalties(logits, seqs)


def sampling_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Rows of adjusted_logits() of sampling sequences -> their probabilities after temperature, top-k,
    top-p and min-p; a row with no finite probability is all zeros (the greedy token stands)."""
    cfgs = [s.gen_config for s in seqs]
    dev, vocab = logits.device, logits.shape[-1]
    rows = logits.nan_to_num(nan=float("-inf"))   # NaN would poison the softmax: never this token
    if any(c.temperature != 1.0 for c in cfgs):
        rows = logits / torch.tensor([c.temperature for c in cfgs], device=dev)[:, None]
        rows = rows.nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    rows = _filter(rows, torch.tensor([min(c.top_k, vocab) for c in cfgs], device=dev),
                   torch.tensor([c.top_p for c in cfgs], device=dev),
                   torch.tensor([c.min_p for c in cfgs], device=dev))
    return rows.softmax(-1).nan_to_num_(nan=0.0)


def sample(logits: torch.Tensor, seqs: list[Sequence], masks: tuple[list[int], torch.Tensor] | None = None
           ) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits [B, V] -> one token per sequence (and its logprobs when asked).

    ``masks``: (rows, bitmask) of the constrained rows (lmport.structured_output.grammar); their forbidden tokens are
    never drawn.
    """
    raw = logits.float()
    logits = adjusted_logits(raw, seqs, masks)
    tokens: dict[int, int] = {}
    sampled = [i for i, s in enumerate(seqs) if samples(s)]
    if sampled:
        probs = sampling_probs(rows_of(logits, sampled), [seqs[i] for i in sampled])
        usable = (probs.sum(-1) > 0).tolist()   # otherwise the greedy token stands
        drawn = [j for j, ok in enumerate(usable) if ok]
        if drawn:
            chosen = draw(rows_of(probs, drawn), [seqs[sampled[j]].generator for j in drawn]).tolist()
            tokens = {sampled[j]: token for j, token in zip(drawn, chosen)}
    greedy = [i for i in range(len(seqs)) if i not in tokens]
    if greedy:
        tokens.update(zip(greedy, greedy_tokens(rows_of(logits, greedy))))
    token_list = [tokens[i] for i in range(len(seqs))]
    return token_list, token_logprobs(raw, seqs, token_list)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's first index of its largest value, NaN counting as -inf: on the host (float32) by numpy's
    argmax, which is vectorised and several times faster than torch's there (it picks a row's first NaN, if
    any: only such a row is searched again without them); elsewhere by max's indices, which torch computes
    faster than argmax's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.numpy()
        tokens = values.argmax(-1).tolist()
        for row, token in enumerate(tokens):
            if math.isnan(values[row, token]):
                tokens[row] = int(np.nan_to_num(values[row], nan=-np.inf).argmax())
        return tokens
    return logits.nan_to_num(nan=float("-inf")).max(-1).indices.tolist()


def rows_of(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for ascending ``rows``: a view, not a gathered copy, where they are consecutive (all of x, a decode
    step's every row, a prompt's last)."""
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        return x[rows[0]:rows[-1] + 1]
    return x[rows]


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token a row of ``probs`` [R, V] (rows with a positive total, not necessarily normalised), each drawn
    with its own generator by the exponential race, argmax p / E over E ~ Exp(1) (E = -log U, U a float64
    uniform), in two rounds: among chunks of DRAW_CHUNK tokens by their masses, then among the tokens of the
    chunk that won. A token's chance is its chunk's times its share of the chunk, as in one race over the
    vocabulary, for a fortieth of the random numbers (torch.multinomial takes one a token). As in one race, the
    winner changes only where two ratios are within rounding of each other, so logits that differ in their
    last bits (in another batch) almost always draw the same token.

    Each request's generator gives the same tokens whatever else is in the batch, and a token of probability
    0 is never drawn.
    """
    rows, vocab = probs.shape
    p = probs.float()
    if vocab % DRAW_CHUNK:
        p = torch.nn.functional.pad(p, (0, -vocab % DRAW_CHUNK))
    p = p.view(rows, -1, DRAW_CHUNK)
    chunks = p.shape[1]
    exponentials = torch.stack([torch.rand(chunks + DRAW_CHUNK, dtype=torch.float64, generator=g,
                                           device=None if g is None else g.device).to(probs.device)
                                for g in generators]).log_().neg_()
    chunk = (p.sum(-1).double() / exponentials[:, :chunks]).argmax(-1)
    within = p[torch.arange(rows, device=probs.device), chunk].double()
    return chunk * DRAW_CHUNK + (within / exponentials[:, chunks:]).argmax(-1)


def draw_one(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """draw() of one row ``p`` [V]."""
    return int(draw(p[None], [generator])[0])


def token_logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[dict[int, float] | None]:
    """Each row's chosen token and top-N logprobs where its request asks for them, else None.

    Logprobs of the model's own distribution (before penalties and filters), as OpenAI reports them.
    """
    logprobs: list[dict[int, float] | None] = [None] * len(seqs)
    wanted = [i for i, s in enumerate(seqs) if s.gen_config.logprobs is not None]
    if wanted:
        lp = raw[wanted].float().log_softmax(-1)
        for j, i in enumerate(wanted):
            top = lp[j].topk(seqs[i].gen_config.logprobs) if seqs[i].gen_config.logprobs else None
            entry = {tokens[i]: lp[j, tokens[i]].item()}
            if top is not None:
                entry.update(zip(top.indices.tolist(), top.values.tolist()))
            logprobs[i] = entry
    return logprobs
