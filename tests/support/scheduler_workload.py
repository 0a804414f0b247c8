"""Randomized scheduler workloads for tests: what a step's forward and sampling would do, and aborts."""
from __future__ import annotations

import random

from lmport.sched.scheduler import ScheduledBatch, Scheduler
from lmport.sched.sequence import Sequence


def run_batch(scheduler: Scheduler, batch: ScheduledBatch, rng: random.Random, targets: dict[str, int]) -> None:
    """Stands in for the forward and sampling: the batch's tokens are computed, a sequence that completes
    gets a random token, and one that reaches its target length finishes."""
    for seq, n in zip(batch.seqs, batch.num_new, strict=True):
        seq.num_computed += n
        assert seq.num_computed <= seq.num_tokens
        if seq.num_uncomputed == 0:
            seq.output_ids.append(rng.randrange(1000))
            if len(seq.output_ids) >= targets[seq.request_id]:
                scheduler.finish(seq)
                seq.finish("length")


def maybe_abort(scheduler: Scheduler, seqs: list[Sequence], rng: random.Random, p: float) -> None:
    """With probability ``p``, one unfinished request (running or waiting alike) is aborted."""
    live = [s for s in seqs if not s.is_finished]
    if live and rng.random() < p:
        victim = rng.choice(live)
        scheduler.finish(victim)
        victim.finish("abort")
