"""Continuous batching: decode first, then new prompts, within a per-step token budget.

While any running sequence is decoding, a step computes at most ``decode_prefill_tokens`` prompt tokens' work
(EngineConfig's; ``lmport serve`` sets 128) besides one token per decoding sequence, so a long prompt cannot
stall the running streams for a whole ``max_prefill_token_num`` chunk; with nothing decoding, or with no
bound (None, the offline default: the fewest, fullest steps), prompts get the whole budget. A prompt token's
work grows with the positions before it, which it attends to (``context_cost``): a chunk deep in a long
prompt is shorter, so that such a step takes no longer than one at the prompt's start.

A long prompt is prefilled in chunks across steps. When blocks run out, a running sequence is preempted
(``victim``): the most recently admitted one of the request running the most sequences (its choices, n > 1), so
that a request asking for many long choices takes turns among its own rather than stalling another client's
stream; with one sequence a request, simply the most recently admitted. Its blocks are freed, its token ids kept,
and it goes back to the front of the waiting queue. On readmission it is recomputed, less what the prefix cache
still holds, or its blocks come back from the host tier when the block manager swapped them out.
Prefix-cache lookups happen at admission; a hit's tokens cost no budget.

With speculative decoding, a decoding sequence also computes the tokens ``lookahead(seq)`` proposes
(lmport.speculative); they are reserved only where the budget and free blocks allow without preempting.

After the worker has run a batch, ``update_from_output`` advances its sequences by the worker's output
(lmport.sched.output): the tokens computed, the tokens drawn appended until one ends the request (a stop token,
a completed format, max_new_tokens, session_len), and the blocks of every request that ended freed.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lmport.engine.outputs import Failure, FinishReason
from lmport.kv.block_manager import BlockManager
from lmport.kv.state_pool import StatePool
from lmport.multimodal.chunks import whole_image_chunk
from lmport.sched.output import ModelOutput, SequenceOutput, Update, failure_of
from lmport.sched.sequence import Sequence, Status
from lmport.structured_output.grammar import MASK_BUDGET_S, MaskTimeout

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new: list[int]      # tokens each sequence computes this step (a proposal's included)
    copies: list = field(default_factory=list)   # device<->host block copies (CopyBatch) to run before it
    # Speculative decoding: the tokens a decoding sequence verifies this step, and the draft probabilities
    # they were drawn from (None: a point mass).
    proposals: dict[Sequence, list[int]] = field(default_factory=dict)
    draft_probs: dict[Sequence, torch.Tensor | None] = field(default_factory=dict)

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
        self.session_len: int | None = None     # tokens a request may reach: it ends there ("length")
        self.accept_budget = MASK_BUDGET_S      # seconds a grammar may take to accept one token
        # A token's attention work per position before it, in units of its other work (the weights it is
        # multiplied by): it sizes the prompt chunks of a step in which other sequences decode (prompt_tokens).
        self.context_cost = 0.0
        # A model with linear-attention layers (Qwen3-Next): each running sequence holds one recurrent-state slot,
        # taken at admission and given back when it ends or is preempted (lmport.kv.state_pool); None otherwise.
        self.state_pool: StatePool | None = None
        # A model whose image tokens attend to each other both ways (Gemma 3): no prompt chunk ends inside an image
        # (lmport.multimodal.chunks).
        self.whole_images = False

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
        # The prompt work this step may do: while others decode, a chunk of decode_prefill_tokens at a prompt's
        # start, counted with each token's attention (prompt_work); else the whole budget, in tokens.
        prefill = self.prompt_work(0, self.decode_prefill_tokens, decoding) if decoding else budget
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget) if seq.num_uncomputed == 1 else seq.step_limit(min(
                seq.num_uncomputed, budget, self.prompt_tokens(seq.num_computed, prefill, decoding)))
            if self.whole_images and seq.num_uncomputed > 1:
                n = whole_image_chunk(seq.images, seq.num_computed, n, budget, self.token_budget)
            if n == 0:
                continue   # a prompt chunk waits for the next step; decoding sequences further on still run
            self.block_manager.release_outside_window(seq)
            if seq.num_uncomputed == 1 and self.lookahead is not None:
                extra = min(self.lookahead(seq), budget - 1)
                if extra > 0 and self.block_manager.can_allocate(seq, 1 + extra):   # never preempt for a proposal
                    n += extra
            while not self.block_manager.can_allocate(seq, n):
                victim = self.victim()
                self._preempt(victim)
                if victim in batch.seqs:   # scheduled earlier in this loop: its place in the step goes too
                    i = batch.seqs.index(victim)
                    del batch.seqs[i], batch.num_new[i]
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.block_manager.allocate(seq, n)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            if seq.num_uncomputed > 1:   # a prompt chunk (num_computed moves after the forward)
                prefill -= self.prompt_work(seq.num_computed, n, decoding)
        self._admit(batch, budget, prefill, decoding)
        batch.copies = self.block_manager.take_copies()
        return batch

    def prompt_work(self, start: int, n: int, decoding: bool) -> float:
        """The work of prompt tokens ``start .. start + n - 1``: while others decode, a token at position p costs
        1 + context_cost * p (its attention over the p before it); else one each."""
        return n + self.context_cost * (n * start + n * (n - 1) / 2) if decoding else n

    def prompt_tokens(self, start: int, work: float, decoding: bool) -> int:
        """The most prompt tokens from position ``start`` whose work (``prompt_work``) fits in ``work``; at least
        one when that is a whole step's, so that a prompt deeper than one step's work still moves."""
        if not decoding or self.context_cost == 0:
            return max(0, int(work))
        if work <= 0:
            return 0
        r, b = self.context_cost, 1 + self.context_cost * (start - 0.5)
        root = (math.sqrt(b * b + 2 * r * work) - b) / r   # where prompt_work(start, n) = work
        fits = math.floor(root + 1e-6)                      # (a chunk at the start that fits exactly, kept whole)
        return fits if fits > 0 or work < self.prompt_work(0, self.decode_prefill_tokens, True) else 1

    def _admit(self, batch: ScheduledBatch, budget: int, prefill: float, decoding: bool) -> None:
        """Waiting sequences join the batch while the budget, the blocks and max_batch_size allow."""
        while (self.waiting and budget > 0 and len(self.running) < self.max_batch_size
               and (self.state_pool is None or self.state_pool.can_allocate())):
            seq = self.waiting[0]
            if (tokens := self.prompt_tokens(0, prefill, decoding)) == 0:
                break
            n = self.block_manager.admit(seq, seq.step_limit(min(budget, tokens)))
            if n is None:
                break
            # The chunk starts after what the prefix cache or the host tier gave back: deep in a prompt, it is
            # shorter (its tokens attend to more), its blocks past that given back; one token at least, as it
            # is admitted.
            if (fits := max(1, self.prompt_tokens(seq.num_computed, prefill, decoding))) < n:
                n = fits
                self.block_manager.rollback(seq, seq.num_computed + n)
            if self.whole_images and (whole := whole_image_chunk(seq.images, seq.num_computed, n, budget,
                                                                 self.token_budget)) != n:
                n = whole if whole < n or self.block_manager.can_allocate(seq, whole) else 0
                self.block_manager.rollback(seq, seq.num_computed + n)
                self.block_manager.allocate(seq, n)
            self.waiting.popleft()
            self.block_manager.release_outside_window(seq)   # prefix-cache hits behind the window
            seq.status = Status.RUNNING
            if self.state_pool is not None:
                seq.state_slot = self.state_pool.allocate(seq)
            self.running.append(seq)
            if n == 0:   # its first chunk, a whole image, waits for a step with room (whole_images)
                continue
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            prefill -= self.prompt_work(seq.num_computed, n, decoding)

    def victim(self) -> Sequence:
        """The running sequence to preempt: the most recently admitted of the request running the most."""
        running = Counter(seq.group for seq in self.running if seq.group is not None)
        return max(reversed(self.running), key=lambda seq: running[seq.group] if seq.group is not None else 1)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_state(seq)   # recomputed from its first token on readmission, which rebuilds the state
        swapped = self.block_manager.preempt(seq)   # sets num_computed = 0 unless swapped out
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.debug("preempted %s (%s, %d tokens)", seq.request_id, "swapped" if swapped else "to recompute",
                  seq.num_tokens)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that ended (stop, length, abort or error)."""
        self._release_state(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.block_manager.free(seq)

    def _release_state(self, seq: Sequence) -> None:
        if self.state_pool is not None:
            self.state_pool.free(seq)
            seq.state_slot = -1

    # -- after the worker ran the batch ----------------------------------------------------------------------
    def update_from_output(self, batch: ScheduledBatch, output: ModelOutput) -> list[Update]:
        """Advance each sequence of ``batch`` by what the worker made of it; one Update for each that gained
        tokens or ended (its blocks freed)."""
        if output.failure is not None:   # the forward failed: the batch's requests end with why
            for seq in batch.seqs:
                self.end(seq, FinishReason.ERROR, output.failure)
            return [Update(seq, [], []) for seq in batch.seqs]
        updates = []
        for seq, n in zip(batch.seqs, batch.num_new):
            out = output.seqs.get(seq) or SequenceOutput()
            # Proposed tokens count once accepted: their KV is in the cache, the rejected ones' slots are not.
            seq.num_computed += n - len(batch.proposals.get(seq, ())) + (out.accepted or 0)
            seq.prompt_logprobs += out.prompt_logprobs
            update = self._update(seq, out)
            if seq in batch.proposals and not seq.is_finished:
                self.block_manager.rollback(seq)
            if update is not None:
                updates.append(update)
        return updates

    def _update(self, seq: Sequence, out: SequenceOutput) -> Update | None:
        if out.pooled is not None:   # an embedding request: done once its last position is computed
            if seq.num_uncomputed:
                seq.pooled = out.pooled
                return None
            seq.pooled = None
            self.end(seq, FinishReason.STOP)
            vector = out.pooled / seq.num_tokens if seq.pooling == "mean" else out.pooled
            return Update(seq, [], [], vector.tolist())
        if seq.pooling is None and seq.gen_config.max_new_tokens == 0 and not seq.scoring:
            self.end(seq, FinishReason.LENGTH)   # a prompt scored, nothing to generate
            return Update(seq, [], [])
        appended, logprobs = [], []
        try:
            for token, lp in zip(out.token_ids, out.logprobs):
                self._append(seq, token)
                appended.append(token)
                if lp is not None:   # None: the request asked for none
                    logprobs.append(lp)
                if seq.is_finished:
                    break
        except Exception as exc:   # the grammar refusing the token: this request fails, not the engine
            self.end(seq, FinishReason.ERROR, failure_of("decoding", exc))
        if out.failure is not None and not seq.is_finished:
            self.end(seq, FinishReason.ERROR, out.failure)
        return Update(seq, appended, logprobs) if appended or seq.is_finished else None

    def _append(self, seq: Sequence, token: int) -> None:
        """Append one token: advance the grammar, check the stop token ids and the length. Stop strings are the
        output processor's (text is not made here)."""
        seq.output_ids.append(token)
        if seq.grammar is not None:
            started = time.thread_time()   # CPU time, as the masks are bounded
            seq.grammar.accept_token(token)   # the mask allowed only tokens it accepts
            if (took := time.thread_time() - started) > self.accept_budget:   # on this thread: bounded too
                raise MaskTimeout(f"the grammar took {took * 1000:.0f} ms to accept one token, over the "
                                  f"{self.accept_budget * 1000:.0f} ms budget: simplify it")
        if token in seq.stop_token_ids or (seq.grammar is not None and seq.grammar.is_terminated()):
            self.end(seq, FinishReason.STOP)
        elif len(seq.output_ids) >= seq.gen_config.max_new_tokens or (
                self.session_len is not None and seq.num_tokens >= self.session_len):
            self.end(seq, FinishReason.LENGTH)

    def end(self, seq: Sequence, reason: FinishReason, failure: Failure | None = None) -> None:
        """End a sequence: free its blocks, and record why (a failure is logged)."""
        if failure is not None:
            log.log(logging.INFO if failure.kind == "request" else logging.ERROR, "request %s ended: %s",
                    seq.request_id, failure.message)
        self.finish(seq)
        seq.finish(reason, failure)
