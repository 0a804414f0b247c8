"""Verification: which proposed tokens the target model accepts, and the token it adds after them.

Every position of a proposal is judged on the target's logits at that position, adjusted exactly as
``lmport.worker.sampling`` adjusts them for a plain step (logit bias, repetition, presence and frequency
penalties over the tokens before that position, then temperature, top-k, top-p, min-p):

- greedy: a proposed token is accepted while it equals the target's argmax; at the first that does
  not, the argmax is taken instead. The output is the plain greedy output, token for token.
- sampling: the rejection rule of Leviathan et al. 2023 and Chen et al. 2023. Proposal d drawn from
  the draft's distribution q is accepted with probability min(1, p(d) / q(d)); when it is rejected,
  the token is drawn from norm(max(0, p - q)) and the rest of the proposal is dropped. After a fully
  accepted proposal one more token is drawn from p. Each emitted token is then distributed as p,
  the target's own distribution. n-gram proposals are a point-mass draft (q(d) = 1): d is accepted
  with probability p(d), and a rejection draws from p without d.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lmport.worker.sampling import adjusted_logits, draw_one, greedy_tokens, samples, sampling_probs, token_logprobs
from lmport.sched.sequence import Sequence


@dataclass
class Verdict:
    tokens: list[int]                       # the accepted proposal, then the target's own token
    accepted: int                           # proposed tokens accepted
    logprobs: list[dict[int, float] | None]


def verify(logits: torch.Tensor, seqs: list[Sequence], proposals: list[list[int]],
           draft_probs: list[torch.Tensor | None], masks: tuple[list[int], torch.Tensor] | None = None
           ) -> list[Verdict]:
    """``logits``: the target's rows for each sequence's last token and its proposal, sequence after sequence
    (len(proposal) + 1 rows each); ``draft_probs[i]``: [len(proposal), vocab] probabilities the draft drew
    sequence i's proposal from, or None for a point-mass draft (n-gram, or a greedy draft); ``masks``: the
    structured outputs' (rows, bitmask) over those rows
    (lmport.structured_output.grammar.Matcher.proposal_bitmask): a proposed
    token its row forbids has probability 0 and is rejected."""
    # Row j of a sequence is judged as a plain step would judge it after the first j proposed tokens.
    views = [s if j == 0 else dataclasses.replace(s, output_ids=s.output_ids + p[:j])
             for s, p in zip(seqs, proposals) for j in range(len(p) + 1)]
    adjusted = adjusted_logits(logits, views, masks)
    greedy = greedy_tokens(adjusted)
    drawn = [r for r, v in enumerate(views) if samples(v)]
    probs: dict[int, torch.Tensor] = {}
    if drawn:
        rows = sampling_probs(adjusted[drawn], [views[r] for r in drawn])
        probs = {r: rows[j] for j, r in enumerate(drawn) if rows[j].sum() > 0}   # otherwise greedy stands

    verdicts, start = [], 0
    for seq, proposal, q in zip(seqs, proposals, draft_probs):
        tokens = judge([probs.get(start + j) for j in range(len(proposal) + 1)],
                       greedy[start:start + len(proposal) + 1], proposal, q, seq.generator)
        rows = list(range(start, start + len(tokens)))
        logprobs = token_logprobs(logits[rows], [views[r] for r in rows], tokens)
        verdicts.append(Verdict(tokens, len(tokens) - 1, logprobs))
        start += len(proposal) + 1
    return verdicts


def judge(p: list[torch.Tensor | None], greedy: list[int], proposal: list[int], q: torch.Tensor | None,
          generator: torch.Generator | None) -> list[int]:
    """The emitted tokens of one sequence. ``p[j]``: the target's probabilities at position j, None where
    the position is greedy; ``greedy[j]``: its argmax; ``q``: the draft's probabilities, None for a point mass."""
    out = []
    for j, d in enumerate(proposal):
        target = p[j]
        if target is None:
            if greedy[j] != d:
                return out + [greedy[j]]
        else:
            q_d = 1.0 if q is None else float(q[j, d])
            if not accepts(float(target[d]), q_d, generator):
                return out + [draw_one(residual(target, d if q is None else q[j]), generator)]
        out.append(d)
    last = p[len(proposal)]
    return out + [greedy[len(proposal)] if last is None else draw_one(last, generator)]


def accepts(p_d: float, q_d: float, generator: torch.Generator | None) -> bool:
    """Accept a proposed token with probability min(1, p(d) / q(d))."""
    u = float(torch.rand((), generator=generator, device=generator.device if generator is not None else None))
    return u * q_d < p_d


def residual(p: torch.Tensor, q: torch.Tensor | int) -> torch.Tensor:
    """norm(max(0, p - q)), the distribution after a rejection (``q`` an int: a point mass on that token).
    Where rounding leaves it empty (p <= q everywhere, which a rejection rules out in exact arithmetic), p."""
    if isinstance(q, int):
        r = p.clone()
        r[q] = 0.0
    else:
        r = (p - q).clamp_(min=0.0)
    return r if float(r.sum()) > 0 else p
