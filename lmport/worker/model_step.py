"""A scheduled batch run on the model runners and made into token ids: the worker side of a step.

``ModelStep.execute`` runs the forward (with the block copies scheduling queued) on every rank through the
executor, and on rank 0's logits: the prompt positions a request asked logprobs of are scored, the embedding
requests' rows pooled, the structured outputs' token masks (filled on host threads beside the forward) applied,
and each sequence's next token sampled, or its speculative proposal verified. Its output
(lmport.sched.output.ModelOutput) is what the scheduler updates the sequences from; this side changes none of
them. A failure ends only the request it belongs to; a failed forward ends the batch's.
"""
from __future__ import annotations

import logging
from concurrent import futures

import torch

from lmport.lora.table import AdapterTable
from lmport.sched.output import ModelOutput, failure_of
from lmport.sched.scheduler import ScheduledBatch
from lmport.sched.sequence import Sequence
from lmport.speculative.acceptance import Verdict, verify
from lmport.structured_output.grammar import DEAD_END, FormatDeadEnd, MaskBuilder, Masks, MaskTimeout
from lmport.worker import sampling
from lmport.worker.runner import StepInput
from lmport.engine.outputs import Failure

log = logging.getLogger(__name__)


class ModelStep:
    def __init__(self, executor, masks: MaskBuilder, adapters: AdapterTable, use_lora: bool):
        self.executor, self.masks, self.adapters, self.use_lora = executor, masks, adapters, use_lora

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        output = ModelOutput()
        if not batch.seqs:   # the block copies alone, when no forward carries them
            if batch.copies:
                self.executor.execute(StepInput([], [], [], [], [], batch.copies))
            return output
        # Sequences sampling their next token (a proposal's sequence verifies instead: it computes past its end;
        # an embedding request, or a prompt scored with nothing to generate, samples nothing).
        completing = [s for s, n in zip(batch.seqs, batch.num_new)
                      if s.num_computed + n == s.num_tokens and generates(s)]
        masks = self.masks.start([s.grammar for s in completing])   # filled while the forward runs
        constrained = [s for s in batch.proposals if s.grammar is not None]   # and the proposals' masks too
        proposal_masks = dict(zip(constrained, self.masks.start_proposals(
            [s.grammar for s in constrained], [batch.proposals[s] for s in constrained])))
        try:
            logits = self._forward(batch, output)
        except Exception as exc:  # a failing forward ends this batch's requests, not the engine
            log.exception("forward failed")
            futures.wait(proposal_masks.values())   # the matchers are theirs until the fills end
            output.failure = Failure(self.executor.failure or f"forward failed: {type(exc).__name__}: {exc}")
            return output
        ready = completing
        if batch.proposals:   # the verifying sequences' rows come out; the others' stay in batch order
            sampling_now = set(ready)
            counts = [len(batch.proposals[s]) + 1 if s in batch.proposals else int(s in sampling_now)
                      for s in batch.seqs]
            parts = dict(zip(batch.seqs, logits.split(counts)))
            logits = torch.cat([parts[s] for s in ready]) if ready else logits[:0]
            self._verify(batch, {s: parts[s] for s in batch.proposals}, proposal_masks, output)
        if ready:
            self._sample(logits, ready, masks, output)
        return output

    def _forward(self, batch: ScheduledBatch, output: ModelOutput) -> torch.Tensor:
        """Runs the model; returns logits of the sequences whose uncomputed tokens this step completes (and that
        generate) and of every token of a sequence verifying a proposal (its last token, then the proposed ones).
        The prompt positions scored this step (gen_config.prompt_logprobs) and the embedding requests' pooled
        sums (lmport.engine.pooling) go into ``output``."""
        seqs, num_new, proposals = batch.seqs, batch.num_new, batch.proposals
        ids = [t for s, n in zip(seqs, num_new)
               for t in s.tokens(s.num_computed, s.num_computed + n) + proposals.get(s, [])]
        ends, rows, kept, scored, pool, pooling = 0, [], [], [], [], []
        for s, n in zip(seqs, num_new):
            start, ends = ends, ends + n
            completes = s.num_computed + n == s.num_tokens
            if s.scoring:   # positions first .. last-1 predict prompt tokens first+1 .. last
                first = max(s.num_computed, len(s.prompt_logprobs))
                last = min(s.num_computed + n, len(s.prompt_ids) - 1)
                if last > first:
                    scored.append((s, len(rows), first, last))
                    rows.extend(range(start + first - s.num_computed, start + last - s.num_computed))
            if s.pooling is not None:
                if s.pooling == "mean" or completes:
                    pool.append((start, ends) if s.pooling == "mean" else (ends - 1, ends))
                    pooling.append(s)
            elif s in proposals:
                kept.extend(range(len(rows), len(rows) + n))
                rows.extend(range(start, ends))
            elif completes and generates(s):
                kept.append(len(rows))
                rows.append(ends - 1)
        slots = [self.adapters.slot(s.adapter_id) for s in seqs] if self.use_lora else []
        step = StepInput(ids, list(num_new), [s.num_computed + n for s, n in zip(seqs, num_new)],
                         [s.block_table for s in seqs], rows, batch.copies, slots, pool, [s.state_slot for s in seqs],
                         [step_images(s, n) for s, n in zip(seqs, num_new)] if any(s.images for s in seqs) else [])
        if pool:
            logits, pooled = self.executor.run_all("execute_pooled", step)[0]
            for i, s in enumerate(pooling):   # a "mean" request's first chunk starts its sum (again, if preempted)
                output.of(s).pooled = pooled[i] if s.num_computed == 0 or s.pooled is None else s.pooled + pooled[i]
        else:
            logits = self.executor.execute(step)
        for s, row, first, last in scored:
            output.of(s).prompt_logprobs = prompt_logprobs(logits[row:row + last - first],
                                                           s.prompt_ids[first + 1:last + 1],
                                                           s.gen_config.prompt_logprobs or 0)
        return logits[kept] if scored else logits

    def _verify(self, batch: ScheduledBatch, logits: dict[Sequence, torch.Tensor],
                proposal_masks: dict[Sequence, futures.Future], output: ModelOutput) -> None:
        """Judge each sequence's proposal on its rows of logits: the tokens it emits, and how many proposed ones
        were accepted. A structured output's rows are masked as a plain step's would be (``proposal_masks``,
        filled beside the forward). A failure ends only the sequence it belongs to."""
        proposals, masks, dead_ends = batch.proposals, {}, {}
        for seq, pending in proposal_masks.items():
            try:
                rows, bitmask, dead_ends[seq] = pending.result()
                masks[seq] = (rows, bitmask)
            except Exception as exc:
                output.of(seq).failure = failure_of("grammar", exc)
        seqs = [s for s in proposals if s not in output.seqs or output.seqs[s].failure is None]
        if not seqs:
            return
        try:
            verdicts: list[Verdict | Exception] = list(verify(
                torch.cat([logits[s] for s in seqs]), seqs, [proposals[s] for s in seqs],
                [batch.draft_probs.get(s) for s in seqs], joined_masks(seqs, masks, proposals)))
        except Exception:
            log.exception("verifying a batch of %d proposals failed; verifying each alone", len(seqs))
            verdicts = []
            for s in seqs:
                try:
                    verdicts.extend(verify(logits[s], [s], [proposals[s]], [batch.draft_probs.get(s)], masks.get(s)))
                except Exception as exc:
                    verdicts.append(exc)
        for seq, verdict in zip(seqs, verdicts):
            out = output.of(seq)
            if isinstance(verdict, Exception):
                out.failure = failure_of("sampling", verdict)
                continue
            dead_end = dead_ends.get(seq)
            out.accepted = verdict.accepted
            out.token_ids = verdict.tokens if dead_end is None else verdict.tokens[:dead_end]
            out.logprobs = verdict.logprobs[:len(out.token_ids)]
            if len(out.token_ids) < len(verdict.tokens):   # its token was drawn at a dead end
                out.failure = failure_of("grammar", FormatDeadEnd(DEAD_END))

    def _sample(self, logits: torch.Tensor, ready: list[Sequence], masks: Masks | None, output: ModelOutput) -> None:
        """Each ready sequence's next token, drawn from its logits with its structured output's mask applied."""
        mask = None
        if masks is not None:
            rows, bitmask, overdue = masks.result()   # waits at most the mask budget for a row
            if overdue:   # those requests end with the reason; the batch goes on without them
                for i, why in overdue.items():
                    output.of(ready[i]).failure = failure_of("grammar", MaskTimeout(why))   # the request's fault
                keep = [i for i in range(len(ready)) if i not in overdue]
                index = {old: new for new, old in enumerate(keep)}
                logits, ready, bitmask = logits[keep], [ready[i] for i in keep], bitmask[keep]
                rows = [index[r] for r in rows if r in index]
                if not ready:
                    return
            mask = (rows, bitmask) if rows else None
        for seq, token, lp in sample_each(logits, ready, mask):
            if isinstance(token, Exception):
                output.of(seq).failure = failure_of("sampling", token)
            else:
                out = output.of(seq)
                out.token_ids, out.logprobs = [token], [lp]


def sample_each(logits: torch.Tensor, ready: list[Sequence], mask=None) -> list:
    """(seq, token, logprobs) for each ready sequence; token is the exception when sampling it failed.

    The batch is sampled at once; when that raises, each sequence is sampled alone so
    that only the one whose input made it fail gets the error. ``mask``: the constrained rows and
    their token bitmask (lmport.structured_output.grammar.Masks.result()), or None.
    """
    try:
        tokens, logprobs = sampling.sample(logits, ready, mask)
        return list(zip(ready, tokens, logprobs))
    except Exception:
        log.exception("sampling a batch of %d failed; sampling each request alone", len(ready))
    results = []
    for i, seq in enumerate(ready):
        try:
            rows, bitmask = mask if mask else ([], None)
            one = ([0], bitmask[i:i + 1]) if bitmask is not None and i in rows else None
            (token,), (lp,) = sampling.sample(logits[i:i + 1], [seq], one)
            results.append((seq, token, lp))
        except Exception as exc:
            results.append((seq, exc, None))
    return results


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[dict[int, float]]:
    """{target: log p(target), and the ``top`` most likely tokens'} for each row; the log-softmax is taken through
    logsumexp, never as a second [rows x vocab] array."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    chosen = (logits.gather(1, torch.tensor(targets, device=logits.device)[:, None])[:, 0] - lse).tolist()
    if not top:
        return [{t: lp} for t, lp in zip(targets, chosen)]
    best = logits.topk(top, dim=-1)
    values = (best.values - lse[:, None]).tolist()
    return [{**dict(zip(i, v)), t: lp} for t, lp, i, v in zip(targets, chosen, best.indices.tolist(), values)]


def joined_masks(seqs: list[Sequence], masks: dict[Sequence, tuple[list[int], torch.Tensor]],
                 proposals: dict[Sequence, list[int]]) -> tuple[list[int], torch.Tensor] | None:
    """The structured outputs' proposal masks as one (rows, bitmask) over the verified rows, sequence after
    sequence (len(proposal) + 1 rows each)."""
    if not masks:
        return None
    words = next(iter(masks.values()))[1].shape[1]
    rows, parts, start = [], [], 0
    for seq in seqs:
        count = len(proposals[seq]) + 1
        if seq in masks:
            rows += [start + r for r in masks[seq][0]]
            parts.append(masks[seq][1])
        else:   # rows outside ``rows`` are not masked
            parts.append(torch.zeros(count, words, dtype=torch.int32))
        start += count
    return rows, torch.cat(parts)


def step_images(seq: Sequence, num_new: int) -> list:
    """``seq``'s images for a step computing ``num_new`` of its tokens: with their pixel values where the step
    computes some of their tokens (the encoder runs on them), as their layout alone otherwise (their positions)."""
    start, end = seq.num_computed, seq.num_computed + num_new
    return [image if image.offset < end and image.end > start else image.layout_only() for image in seq.images]


def generates(seq: Sequence) -> bool:
    """Whether the sequence samples tokens: not an embedding request, nor a prompt scored alone."""
    return seq.pooling is None and seq.gen_config.max_new_tokens > 0
