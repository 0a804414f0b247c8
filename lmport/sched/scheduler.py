"""Continuous batching: decode first, then new prompts, within a per-step token budget.

While any running sequence is decoding, a step computes at most ``decode_prefill_tokens`` prompt tokens
(EngineConfig's; ``lmport serve`` sets 128) besides one token per decoding sequence, so a long prompt cannot
stall the running streams for a whole ``max_prefill_token_num`` chunk; with nothing decoding, or with no
bound (None, the offline default: the fewest, fullest steps), prompts get the whole budget.

A long prompt is prefilled in chunks across steps. When blocks run out, the
most recently admitted running sequence is preempted: its blocks are freed,
its token ids kept, and it goes back to the front of the waiting queue. On
readmission it is recomputed, less what the prefix cache still holds, or its
blocks come back from the host tier when the block manager swapped them out.
Prefix-cache lookups happen at admission; a hit's tokens cost no budget.

With speculative decoding, a decoding sequence also computes the tokens ``lookahead(seq)`` proposes
(lmport.speculative); they are reserved only where the budget and free blocks allow without preempting.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lmport.kv.block_manager import BlockManager
from lmport.sched.sequence import Sequence, Status

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new: list[int]      # tokens each sequence computes this step

    def __bool__(self):
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_prefill_token_num: int,
                 decode_prefill_tokens: int | None = None):
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.token_budget = max_prefill_token_num
        bound = decode_prefill_tokens or max_prefill_token_num
        self.decode_prefill_tokens = max(1, min(bound, max_prefill_token_num))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order
        self.num_preemptions = 0
        # Speculative decoding: proposed tokens a decoding sequence verifies this step (None: no speculation).
        self.lookahead: Callable[[Sequence], int] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.token_budget
        for seq in self.running:    # last step's full blocks become visible to this step's lookups
            self.block_manager.cache_computed(seq)
        decoding = any(seq.num_uncomputed == 1 for seq in self.running)
        prefill = self.decode_prefill_tokens if decoding else budget   # prompt tokens this step may compute
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget) if seq.num_uncomputed == 1 else seq.step_limit(min(
                seq.num_uncomputed, budget, prefill))
            if n == 0:
                continue   # a prompt chunk waits for the next step; decoding sequences further on still run
            self.block_manager.release_outside_window(seq)
            if seq.num_uncomputed == 1 and self.lookahead is not None:
                extra = min(self.lookahead(seq), budget - 1)
                if extra > 0 and self.block_manager.can_allocate(seq, 1 + extra):   # never preempt for a proposal
                    n += extra
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.block_manager.allocate(seq, n)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            if seq.num_uncomputed > 1:   # a prompt chunk (num_computed moves after the forward)
                prefill -= n

        while self.waiting and min(budget, prefill) > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            n = self.block_manager.admit(seq, seq.step_limit(min(budget, prefill)))
            if n is None:
                break
            self.waiting.popleft()
            self.block_manager.release_outside_window(seq)   # prefix-cache hits behind the window
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            prefill -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        swapped = self.block_manager.preempt(seq)   # sets num_computed = 0 unless swapped out
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.debug("preempted %s (%s, %d tokens)", seq.request_id, "swapped" if swapped else "to recompute",
                  seq.num_tokens)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that ended (stop, length, abort or error)."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.block_manager.free(seq)
