"""What the worker made of a scheduled batch (``ModelOutput``), which the scheduler updates its sequences from
(``Scheduler.update_from_output``), and what that update gives the engine core back (``Update``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lmport.engine.outputs import ErrorKind, Failure
from lmport.sched.sequence import Sequence
from lmport.structured_output.grammar import FORMAT_FAULT, GuidedDecodingError


@dataclass
class SequenceOutput:
    """One sequence's part of a step's output."""
    # Tokens to append in order: the one sampled, or a verified proposal's accepted tokens and the next.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)   # each token's (None: none asked)
    accepted: int | None = None    # a sequence that verified a proposal: how many proposed tokens were accepted
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)   # the prompt positions scored this step
    pooled: torch.Tensor | None = None   # an embedding request's pooled sum over its positions computed so far
    failure: Failure | None = None       # ends the request (after ``token_ids``, unless one of them ended it)


@dataclass
class ModelOutput:
    seqs: dict[Sequence, SequenceOutput] = field(default_factory=dict)
    failure: Failure | None = None   # the forward failed: every request of the batch ends with it

    def of(self, seq: Sequence) -> SequenceOutput:
        out = self.seqs.get(seq)
        if out is None:
            out = self.seqs[seq] = SequenceOutput()
        return out


class Update(NamedTuple):
    """A sequence with news this step: the tokens appended (and their logprobs), or its end."""
    seq: Sequence
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    embedding: list[float] | None = None


def failure_of(stage: str, exc: Exception) -> Failure:
    """The failure an exception in ``stage`` ends one request with. A format's (a dead end, a grammar over its
    budget) is the request's fault; anything else is the server's."""
    if isinstance(exc, GuidedDecodingError):
        return Failure(FORMAT_FAULT + str(exc), ErrorKind.REQUEST)
    return Failure(f"{stage} failed: {type(exc).__name__}: {exc}")
