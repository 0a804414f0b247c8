"""The engine: requests in, one batched forward a step, outputs out.

``Engine`` is synchronous (``add_request`` / ``step`` / ``abort``); the
engine core loop that serves it to the HTTP front end is ``lmport.engine.core_process``.
Every request ends finished ("stop" / "length"), aborted, or with an error.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from concurrent import futures
from typing import cast

import torch

from lmport.platform.backend import Backend
from lmport.config import ConfigError, EngineConfig, GenerationConfig
from lmport.dtypes import torch_dtype
from lmport.executor.local import make_executor
from lmport.structured_output.grammar import (DEAD_END, FORMAT_FAULT, FormatDeadEnd, Grammars, GuidedDecodingError,
                                              MaskBuilder, MaskTimeout)
from lmport.kv.layout import KVLayout
from lmport.lora.peft import read_peft_adapter
from lmport.lora.table import AdapterTable, LoadedAdapter
from lmport.memory.budget import CachePlan, MemoryInputs
from lmport.models.loader import read_model_config, resolve_model_path
from lmport.models.lora import LoraLayers
from lmport.models.windows import kv_window
from lmport.engine.output_processor import OutputProcessor, RequestOutput
from lmport.engine.output_processor import is_request_fault as is_request_fault   # for the server
from lmport.kv import host_tier
from lmport.kv.block_manager import BlockManager
from lmport.kv.prefix_cache import model_fingerprint
from lmport.parallel import check_tp
from lmport.worker.pooling import POOLING_MODES
from lmport.platform.resolution import resolve_config
from lmport.worker.runner import ModelRunner, StepInput
from lmport.worker.sampling import sample
from lmport.sched.scheduler import ScheduledBatch, Scheduler
from lmport.sched.sequence import Sequence
from lmport.speculative.acceptance import Verdict, verify
from lmport.speculative.draft import DraftModel, check_draft
from lmport.speculative.speculator import Speculator
from lmport.units import fmt_bytes
from lmport.weights.checkpoint import check_backend, check_tensor_parallel

log = logging.getLogger(__name__)

SCORING_LOGITS_BUDGET = 64 * 2**20   # bytes of float32 logits one step may hold for a prompt's logprobs


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the problem and the fix."""


def check_prompt(prompt_ids, vocab: int, session_len: int) -> None:
    """RequestError naming the problem when an engine of this vocabulary and session_len cannot take the prompt."""
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise RequestError("the prompt is empty: give at least one token")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
        raise RequestError(f"prompt token ids must be ints in [0, {vocab})")
    if len(prompt_ids) >= session_len:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens but session_len is {session_len} "
            f"(room for the prompt and at least one generated token): shorten the prompt or raise session_len")


class Engine:
    def __init__(self, model: str = "smollm2", config: EngineConfig | None = None, backend: Backend | None = None):
        """``backend`` injects an instance of the configured backend, e.g. one whose
        ops run on CPU tensors (Triton interpreter, simulated vendor SDK) in tests."""
        self.config = resolve_config(config or EngineConfig())
        spec = self.config.speculative
        if spec is not None and spec.method == "draft":
            check_draft(model, self.config)   # before any weight loads
        backend_cls = self.config.backend_class()
        # A quantized checkpoint the backend cannot run is refused before the device or a weight is touched.
        path = resolve_model_path(model)
        check_backend(path, backend_cls.capabilities, self.config.weight_format)
        if backend is not None and not isinstance(backend, backend_cls):
            raise ConfigError(f"backend {type(backend).__name__} is not the configured {self.config.device_type!r} "
                              f"backend ({backend_cls.__name__})")
        backend = backend or backend_cls()
        self.dtype = torch_dtype(self.config.dtype)
        if self.config.node_rank != 0:
            raise ConfigError(f"node_rank={self.config.node_rank}: the engine runs on node 0; other nodes run "
                              f"`lmport worker MODEL` with the same flags (docs/distributed.md)")
        check_tp(read_model_config(model), self.config.tp)   # before any weight loads
        check_tensor_parallel(path, self.config.tp, self.config.weight_format)
        # The model runners (one a rank): docs/engine.md. Rank 0's lives in this process.
        if self.config.executor == "ray" and self.config.tp > 1:
            from lmport.executor.ray_executor import RayExecutor
            self.executor = RayExecutor(model, self.config, backend)
        else:
            self.executor = make_executor(model, self.config, backend)
        self.model_name = model
        self.draft = None
        try:
            if spec is not None and spec.method == "draft":   # loaded before the cache is planned beside it
                self.draft = DraftModel(cast(str, spec.model), self.config, self.backend)
            self._allocate_cache(model)
            if self.draft is not None:
                self.draft.allocate(self.plan.num_blocks, self.block_manager.prefix_hashes)
        except BaseException:
            self.executor.close()
            raise
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self.stats = {"steps": 0, "generated_tokens": 0, "prompt_tokens": 0}
        # The text of the outputs ``step`` returns (lmport.engine.output_processor). An engine core serving a front end
        # has none: its outputs carry token ids only, and the front end's processor decodes them.
        self.output_processor: OutputProcessor | None = OutputProcessor(self.tokenizer, cumulative=True)
        # Structured outputs (docs/engine.md): grammars compiled once per format, masks built beside the forward.
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.masks = MaskBuilder(self.model_config.vocab_size)
        # Prompt positions a step may score: their float32 logits stay within SCORING_LOGITS_BUDGET.
        self.scoring_chunk = max(1, min(SCORING_LOGITS_BUDGET // (4 * self.model_config.vocab_size),
                                        self.config.max_prefill_token_num))
        self.adapters = AdapterTable(self.config.max_loras)   # LoRA adapters (docs/lora.md)
        self._pooled: dict[str, torch.Tensor] = {}   # embedding requests' pooled sums so far (lmport.worker.pooling)
        # Speculative decoding (docs/speculative.md): the scheduler reserves slots for each proposal.
        self.speculator = None
        if self.config.speculative is not None:
            self.speculator = Speculator(self.config.speculative, self.session_len,
                                         lambda: len(self.scheduler.running), self.draft)
            self.scheduler.lookahead = self.speculator.lookahead

    # -- what rank 0's model runner loaded and planned: read from it, never copied -------------------------
    @property
    def runner(self) -> ModelRunner:
        return cast(ModelRunner, self.executor.runner)   # set once the executor is built

    @property
    def backend(self) -> Backend:
        return self.runner.backend

    @property
    def model(self):
        return self.runner.loaded.model

    @property
    def tokenizer(self):
        return self.runner.loaded.tokenizer

    @property
    def model_config(self):
        return self.runner.loaded.config

    @property
    def eos_token_ids(self):
        return self.runner.loaded.eos_token_ids

    @property
    def weight_bytes(self) -> int:
        return self.runner.loaded.weight_bytes

    @property
    def layout(self) -> KVLayout:
        return self.runner.layout

    @property
    def memory_inputs(self) -> MemoryInputs:
        return cast(MemoryInputs, self.runner.memory_inputs)   # planned in _allocate_cache

    @property
    def plan(self) -> CachePlan:
        return cast(CachePlan, self.runner.plan)

    @property
    def session_len(self) -> int:
        return self.plan.session_len

    def _allocate_cache(self, model: str) -> None:
        """Plans and allocates the KV cache on every rank, and builds the block manager and scheduler over it."""
        loaded, cfg = self.runner.loaded, self.model_config
        # Memory plan (docs/memory.md): every rank plans its cache from its own free memory with the same
        # lmport.memory.budget.plan_cache as `lmport plan`; all allocate the smallest block count of any rank.
        num_blocks = min(self.executor.run_all("plan_memory"))
        num_host_blocks = host_tier.host_pool_blocks(self.layout, self.config.host_cache_gib)
        self.executor.run_all("allocate", num_blocks, num_host_blocks)
        log.info("memory plan (each of %d ranks): weights %s, activation reserve %s (%s), cache %s = %d blocks x %d "
                 "tokens (quant_policy %d), session_len %d", self.config.tp, fmt_bytes(loaded.weight_bytes),
                 fmt_bytes(self.plan.reserve_bytes),
                 "measured" if self.memory_inputs.reserve_measured else "estimated",
                 fmt_bytes(self.plan.cache_bytes), self.plan.num_blocks, self.layout.block_size,
                 self.config.quant_policy, self.session_len)

        # Prefix cache and host tier: docs/prefix-caching.md. Where every layer slides, the blocks behind the
        # window are freed as sequences grow (lmport.kv.window); a prefix's early blocks then outlive no
        # holder and the cache keeps losing chains' heads, so prefix caching is off there (docs/engine.md).
        window = kv_window(cfg)
        prefix_caching = self.config.enable_prefix_caching and window is None
        if self.config.enable_prefix_caching and not prefix_caching:
            log.warning("prefix caching is off: every layer of %s slides over %d tokens, and the blocks behind "
                        "the window are freed", cfg.model_type, window)
        self.block_manager = BlockManager(
            self.plan.num_blocks, self.config.block_size, enable_prefix_caching=prefix_caching,
            num_host_blocks=num_host_blocks, bytes_per_block=self.layout.bytes_per_block,
            flops_per_token=2 * self.config.tp * loaded.num_parameters,   # ~2 FLOPs a parameter a token
            seed=model_fingerprint(model, cfg.to_dict(), self.config.dtype, self.config.quant_policy,
                                   self.config.kv_cache_dtype),
            window=window)
        self.scheduler = Scheduler(self.block_manager, self.config.max_batch_size, self.config.max_prefill_token_num,
                                   self.config.decode_prefill_tokens)

    # -- requests --------------------------------------------------------
    def add_request(self, prompt_ids: list[int], gen_config: GenerationConfig | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, adapter: str | None = None,
                    pooling: str | None = None, scoring_chunk: int | None = None) -> str:
        """Queue a request; raises RequestError (and queues nothing) for input it cannot serve.
        ``adapter``: the name of a loaded LoRA adapter to run it with (AdapterError when none is loaded so).
        ``pooling``: an embedding request ("mean" or "last", lmport.worker.pooling): the prompt is prefilled with the
        other requests' steps, nothing is generated, and its final output carries the pooled hidden state.
        ``scoring_chunk``: prompt positions a step may score (gen_config.prompt_logprobs), at most the engine's
        ``scoring_chunk`` by default."""
        gen_config = gen_config or GenerationConfig()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids)
        if pooling not in (None, *POOLING_MODES):
            raise RequestError(f"pooling must be one of {', '.join(POOLING_MODES)}, got {pooling!r}")
        if pooling == "mean":   # every position's hidden state is needed: no prefix-cache hit may skip one
            cache_salt = f"\0mean-pooling:{uuid.uuid4().hex}"
        stop = set(gen_config.stop_token_ids if gen_config.stop_token_ids is not None else self.eos_token_ids)
        if gen_config.ignore_eos:
            stop -= set(self.eos_token_ids)
        generator = None
        if not gen_config.greedy:
            generator = torch.Generator(device=self.backend.device)
            generator.manual_seed(gen_config.random_seed if gen_config.random_seed is not None
                                  else torch.seed())
        try:
            grammar = self.grammars.matcher(gen_config.response_format)
        except GuidedDecodingError as exc:
            raise RequestError(str(exc)) from None
        adapter_id = self.adapters.acquire(adapter).id if adapter is not None else 0
        seq = Sequence(request_id, list(prompt_ids), gen_config, frozenset(stop), generator=generator,
                       cache_salt=cache_salt, grammar=grammar,
                       max_scoring_tokens=scoring_chunk or self.scoring_chunk,
                       adapter_id=adapter_id, pooling=pooling)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        if self.output_processor is not None:
            self.output_processor.add(request_id, gen_config)
        self.stats["prompt_tokens"] += len(prompt_ids)
        return request_id

    def validate(self, prompt_ids) -> None:
        if self.failure:
            raise RequestError(f"the engine cannot run the model: {self.failure}")
        check_prompt(prompt_ids, self.model_config.vocab_size, self.session_len)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        if self.speculator is not None:
            self.speculator.forget(seq)
        self.scheduler.finish(seq)
        seq.finish("abort")
        self._pooled.pop(request_id, None)
        self.adapters.release(seq.adapter_id)
        self._pending_outputs.append(self._output(seq, []))
        del self.seqs[request_id]
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    # -- one step --------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs: with their text (``output_processor``), or token ids only without one. A
        request that a stop string ended (or whose text could not be decoded) ends here too."""
        outputs = self._step()
        if self.output_processor is None:
            return outputs
        outputs, ended = self.output_processor.process(outputs)
        for out in ended:
            if (seq := self.seqs.get(out.request_id)) is not None:
                self._end(seq, cast(str, out.finish_reason), out.error)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One step of the core: every output carries its new token ids and logprobs, no text."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.failure:   # a rank is gone: nothing can run, and every request ends with why
            for seq in list(self.seqs.values()):
                self._end(seq, "error", self.failure)
                outputs.append(self._output(seq, []))
            return outputs
        batch = self.scheduler.schedule()
        if not batch:
            self._copy_blocks()
            return outputs
        self.stats["steps"] += 1
        payoff = self.speculator.payoff if self.speculator is not None else None
        if payoff is None or not all(s.num_uncomputed == 1 and s.pooling is None for s in batch.seqs):
            return self._run(batch, outputs)
        # A decode step: timed for the judgment whether verifying proposals pays (Payoff).
        emitted, started = sum(len(s.output_ids) for s in batch.seqs), payoff.clock()
        outputs = self._run(batch, outputs)
        payoff.observe(len(batch.seqs), sum(batch.num_new) > len(batch.seqs),
                       sum(len(s.output_ids) for s in batch.seqs) - emitted, payoff.clock() - started)
        return outputs

    def _run(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One scheduled batch: forward, verify or sample, append; ``outputs`` gains this step's."""
        proposals, draft_probs = self._proposals(batch.seqs, batch.num_new)
        # Sequences sampling their next token (a proposal's sequence verifies instead: it computes past its end;
        # an embedding request, or a prompt scored with nothing to generate, samples nothing).
        completing = [s for s, n in zip(batch.seqs, batch.num_new)
                      if s.num_computed + n == s.num_tokens and _generates(s)]
        masks = self.masks.start([s.grammar for s in completing])   # filled while the forward runs
        constrained = [s for s in proposals if s.grammar is not None]   # and the proposals' masks too
        proposal_masks = dict(zip(constrained, self.masks.start_proposals([s.grammar for s in constrained],
                                                                          [proposals[s] for s in constrained])))
        try:
            logits = self._forward(batch.seqs, batch.num_new, proposals)
        except Exception as exc:  # a failing forward ends this batch's requests, not the engine
            log.exception("forward failed")
            futures.wait(proposal_masks.values())   # the matchers are theirs until the fills end
            for seq in batch.seqs:
                self._end(seq, "error", self.failure or f"forward failed: {type(exc).__name__}: {exc}")
                outputs.append(self._output(seq, []))
            return outputs + self._step() if self.failure else outputs

        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n - len(proposals.get(seq, ()))   # proposed tokens count once accepted
        for seq in batch.seqs:   # a prompt scored, nothing to generate (its last token, predicting nothing, never runs)
            if seq.pooling is None and seq.gen_config.max_new_tokens == 0 and not seq.scoring:
                self._end(seq, "length")
                outputs.append(self._output(seq, []))
        if isinstance(logits, tuple):   # embedding requests in the batch
            logits, pooled = logits
            outputs += self._pool(batch.seqs, batch.num_new, pooled)
        ready = completing
        if proposals:   # the verifying sequences' rows come out; the others' stay in batch order
            sampling = set(ready)
            counts = [len(proposals[s]) + 1 if s in proposals else int(s in sampling) for s in batch.seqs]
            parts = dict(zip(batch.seqs, logits.split(counts)))
            logits = torch.cat([parts[s] for s in ready]) if ready else logits[:0]
            outputs += self._verify({s: parts[s] for s in proposals}, proposals, draft_probs, proposal_masks)
        if not ready:
            return outputs
        mask = None
        if masks is not None:
            rows, bitmask, overdue = masks.result()   # waits at most the mask budget for a row
            if overdue:   # those requests end with the reason; the batch goes on without them
                for i, why in overdue.items():
                    outputs.append(self._fail(ready[i], "grammar", MaskTimeout(why)))   # the request's fault
                keep = [i for i in range(len(ready)) if i not in overdue]
                index = {old: new for new, old in enumerate(keep)}
                logits, ready, bitmask = logits[keep], [ready[i] for i in keep], bitmask[keep]
                rows = [index[r] for r in rows if r in index]
                if not ready:
                    return outputs
            mask = (rows, bitmask) if rows else None
        for seq, token, lp in self._sample(logits, ready, mask):
            if isinstance(token, Exception):
                outputs.append(self._fail(seq, "sampling", token))
                continue
            try:
                outputs.append(self._append_all(seq, [token], [lp]))
            except Exception as exc:  # the grammar refusing the token: this request fails, not the engine
                outputs.append(self._fail(seq, "decoding", exc))
        return outputs

    def _sample(self, logits: torch.Tensor, ready: list[Sequence], mask=None):
        """(seq, token, logprobs) for each ready sequence; token is the exception when sampling it failed.

        The batch is sampled at once; when that raises, each sequence is sampled alone so
        that only the one whose input made it fail gets the error. ``mask``: the constrained rows and
        their token bitmask (lmport.structured_output.grammar.Masks.result()), or None.
        """
        try:
            tokens, logprobs = sample(logits, ready, mask)
            return list(zip(ready, tokens, logprobs))
        except Exception:
            log.exception("sampling a batch of %d failed; sampling each request alone", len(ready))
        results = []
        for i, seq in enumerate(ready):
            try:
                rows, bitmask = mask if mask else ([], None)
                mask = ([0], bitmask[i:i + 1]) if bitmask is not None and i in rows else None
                (token,), (lp,) = sample(logits[i:i + 1], [seq], mask)
                results.append((seq, token, lp))
            except Exception as exc:
                results.append((seq, exc, None))
        return results

    def _fail(self, seq: Sequence, stage: str, exc: Exception) -> RequestOutput:
        """End one request with an error. A format's failure (a dead end, a grammar over its budget) is the
        request's fault and says so (``is_request_fault``); anything else is the server's."""
        if isinstance(exc, GuidedDecodingError):
            log.info("request %s ended by its format: %s", seq.request_id, exc)
            error = FORMAT_FAULT + str(exc)
        else:
            log.error("request %s failed in %s: %s: %s", seq.request_id, stage, type(exc).__name__, exc)
            error = f"{stage} failed: {type(exc).__name__}: {exc}"
        if not seq.is_finished:
            self._end(seq, "error", error)
        return self._output(seq, [])

    @property
    def failure(self) -> str | None:
        """Why the model cannot run any more (a tensor-parallel rank died or raised), else None."""
        return self.executor.failure

    def _copy_blocks(self) -> None:
        """Run the device<->host block copies scheduling queued (on every rank), when no forward carries them."""
        copies = self.block_manager.take_copies()
        if copies:
            self.executor.execute(StepInput([], [], [], [], [], copies))

    def _proposals(self, seqs: list[Sequence], num_new: list[int]
                   ) -> tuple[dict[Sequence, list[int]], dict[Sequence, torch.Tensor | None]]:
        """The tokens each decoding sequence with reserved slots verifies this step, and the draft
        probabilities they were drawn from; ``num_new`` shrinks to what was proposed (and the blocks reserved
        past it are given back)."""
        if self.speculator is None:
            return {}, {}
        slots = {seq: num_new[i] - 1 for i, seq in enumerate(seqs)
                 if num_new[i] > 1 and seq.num_uncomputed == 1 and seq.pooling is None}
        proposals, probs = self.speculator.proposals(slots)
        for i, seq in enumerate(seqs):
            if seq in slots and len(proposals.get(seq, ())) < slots[seq]:
                num_new[i] = 1 + len(proposals.get(seq, ()))
                self.block_manager.rollback(seq, seq.num_computed + num_new[i])
        return {s: p for s, p in proposals.items() if p}, probs

    def _forward(self, seqs: list[Sequence], num_new: list[int],
                 proposals: dict[Sequence, list[int]] | None = None):
        """Runs the model; returns logits of the sequences whose uncomputed tokens this step completes (and that
        generate) and of every token of a sequence verifying a proposal (its last token, then the proposed ones),
        with the sums of the embedding requests' pooled rows (lmport.worker.pooling) beside them when the batch has any.
        The log-probabilities of the prompt positions scored this step (gen_config.prompt_logprobs) are recorded
        on their sequences."""
        proposals = proposals or {}
        ids = [t for s, n in zip(seqs, num_new)
               for t in s.tokens(s.num_computed, s.num_computed + n) + proposals.get(s, [])]
        ends, rows, kept, scored, pool = 0, [], [], [], []
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
            elif s in proposals:
                kept.extend(range(len(rows), len(rows) + n))
                rows.extend(range(start, ends))
            elif completes and _generates(s):
                kept.append(len(rows))
                rows.append(ends - 1)
        slots = [self.adapters.slot(s.adapter_id) for s in seqs] if self.config.max_loras else []
        step = StepInput(ids, list(num_new), [s.num_computed + n for s, n in zip(seqs, num_new)],
                         [s.block_table for s in seqs], rows, self.block_manager.take_copies(), slots, pool)
        if pool:
            logits, pooled = self.executor.run_all("execute_pooled", step)[0]
        else:
            logits, pooled = self.executor.execute(step), None
        for s, row, first, last in scored:
            s.prompt_logprobs += _prompt_logprobs(logits[row:row + last - first], s.prompt_ids[first + 1:last + 1],
                                                  s.gen_config.prompt_logprobs or 0)
        if scored:
            logits = logits[kept]
        return (logits, pooled) if pool else logits

    def _pool(self, seqs: list[Sequence], num_new: list[int], pooled: torch.Tensor) -> list[RequestOutput]:
        """Adds this step's pooled sums to each embedding request's; ends those now complete with their vector."""
        outputs, i = [], 0
        for seq, n in zip(seqs, num_new):
            if seq.pooling is None or (seq.pooling == "last" and seq.num_uncomputed):
                continue
            if seq.pooling == "mean" and seq.num_computed == n:   # its first chunk (again, after a preemption)
                self._pooled[seq.request_id] = torch.zeros_like(pooled[i])
            total = self._pooled.pop(seq.request_id, 0) + pooled[i]
            i += 1
            if seq.num_uncomputed:
                self._pooled[seq.request_id] = total
                continue
            vector = total / seq.num_tokens if seq.pooling == "mean" else total
            self._end(seq, "stop")
            outputs.append(dataclasses.replace(self._output(seq, []), embedding=vector.tolist()))
        return outputs

    def _verify(self, logits: dict[Sequence, torch.Tensor], proposals: dict[Sequence, list[int]],
                draft_probs: dict[Sequence, torch.Tensor | None],
                proposal_masks: dict[Sequence, futures.Future]) -> list[RequestOutput]:
        """Judge each sequence's proposal on its rows of logits, append what it emits, give back the KV slots
        of its rejected tokens. A structured output's rows are masked as a plain step's would be
        (``proposal_masks``, filled beside the forward). A failure ends only the sequence it belongs to."""
        outputs, masks, dead_ends = [], {}, {}
        for seq, pending in proposal_masks.items():
            try:
                rows, bitmask, dead_ends[seq] = pending.result()
                masks[seq] = (rows, bitmask)
            except Exception as exc:
                outputs.append(self._fail(seq, "grammar", exc))
        seqs = [s for s in proposals if not s.is_finished]
        if not seqs:
            return outputs
        try:
            verdicts: list[Verdict | Exception] = list(verify(
                torch.cat([logits[s] for s in seqs]), seqs, [proposals[s] for s in seqs],
                [draft_probs.get(s) for s in seqs], _joined_masks(seqs, masks, proposals)))
        except Exception:
            log.exception("verifying a batch of %d proposals failed; verifying each alone", len(seqs))
            verdicts = []
            for s in seqs:
                try:
                    verdicts.extend(verify(logits[s], [s], [proposals[s]], [draft_probs.get(s)], masks.get(s)))
                except Exception as exc:
                    verdicts.append(exc)
        for seq, verdict in zip(seqs, verdicts):
            if isinstance(verdict, Exception):
                outputs.append(self._fail(seq, "sampling", verdict))
                continue
            cast(Speculator, self.speculator).record(seq, len(proposals[seq]), verdict.accepted)
            seq.num_computed += verdict.accepted   # the accepted proposed tokens' KV is in the cache
            dead_end = dead_ends.get(seq)
            tokens = verdict.tokens if dead_end is None else verdict.tokens[:dead_end]
            try:
                outputs.append(self._append_all(seq, tokens, verdict.logprobs))
                if len(tokens) < len(verdict.tokens) and not seq.is_finished:   # its token was drawn at a dead end
                    outputs.append(self._fail(seq, "grammar", FormatDeadEnd(DEAD_END)))
            except Exception as exc:
                outputs.append(self._fail(seq, "decoding", exc))
            if not seq.is_finished:
                self.block_manager.rollback(seq)
        return outputs

    def _append_all(self, seq: Sequence, tokens: list[int], logprobs: list) -> RequestOutput:
        """Append tokens in order until one ends the request; one output for them all."""
        appended, appended_logprobs = [], []
        for token, lp in zip(tokens, logprobs):
            self._push(seq, token)
            appended.append(token)
            if lp is not None:   # None: the request asked for none
                appended_logprobs.append(lp)
            if seq.is_finished:
                break
        return self._output(seq, appended, appended_logprobs)

    def _push(self, seq: Sequence, token: int) -> None:
        """Append one token: advance the grammar, check the stop token ids and the length. Stop strings are the
        output processor's (text is not made here)."""
        seq.output_ids.append(token)
        self.stats["generated_tokens"] += 1
        cfg = seq.gen_config
        if seq.grammar is not None:
            started = time.thread_time()   # CPU time, as the masks are bounded
            seq.grammar.accept_token(token)   # the mask allowed only tokens it accepts
            if (took := time.thread_time() - started) > self.masks.budget:   # on this thread: bounded too
                raise MaskTimeout(f"the grammar took {took * 1000:.0f} ms to accept one token, over the "
                                  f"{self.masks.budget * 1000:.0f} ms budget: simplify it")
        if token in seq.stop_token_ids or (seq.grammar is not None and seq.grammar.is_terminated()):
            self._end(seq, "stop")
        elif len(seq.output_ids) >= cfg.max_new_tokens or seq.num_tokens >= self.session_len:
            self._end(seq, "length")

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq)
        self.scheduler.finish(seq)
        self._pooled.pop(seq.request_id, None)
        if not seq.is_finished:
            self.adapters.release(seq.adapter_id)
        seq.finish(reason, error)
        self.seqs.pop(seq.request_id, None)

    def _output(self, seq: Sequence, new_tokens: list[int], new_logprobs: list | None = None) -> RequestOutput:
        """The core's output: the new token ids and their logprobs, no text (lmport.engine.output_processor). The
        prompt's logprobs come on the first output with tokens, the prompt being scored by then (a stop string
        may end the request before the core does), and on the finished one."""
        first = bool(new_tokens) and len(seq.output_ids) == len(new_tokens)
        scored = seq.gen_config.prompt_logprobs is not None and (seq.is_finished or first)
        return RequestOutput(
            request_id=seq.request_id, token_ids=[], text="", delta_token_ids=new_tokens, delta_text="",
            finished=seq.is_finished, finish_reason=seq.finish_reason, prompt_tokens=len(seq.prompt_ids),
            cached_tokens=seq.num_cached_prefix, error=seq.error,
            delta_logprobs=new_logprobs or [],
            prompt_logprobs=seq.prompt_logprobs if scored else None)

    # -- LoRA adapters (docs/lora.md) ---------------------------------------
    def read_adapter(self, path: str):
        """The peft adapter at ``path``, checked against this model (lmport.lora.peft); touches no engine state,
        so a server reads it off the engine thread. AdapterError for one that cannot be served."""
        self.adapters.free_slot()   # max_loras=0: refused before reading anything
        lora = cast(LoraLayers, self.runner.lora)   # max_loras >= 1 here: the runner made them
        return read_peft_adapter(path, lora.shapes, self.config.max_lora_rank, self.dtype)

    def load_adapter(self, name: str, path: str, adapter=None) -> LoadedAdapter:
        """Serve the peft adapter at ``path`` as ``name`` (``adapter``: already read by ``read_adapter``)."""
        self.adapters.check_name(name)
        slot = self.adapters.free_slot()
        adapter = adapter if adapter is not None else self.read_adapter(path)
        self.executor.run_all("load_adapter", slot, adapter.weights)
        loaded = self.adapters.add(name, slot, adapter.path, adapter.rank)
        log.info("LoRA adapter %r loaded from %s (rank %d, slot %d)", name, adapter.path, adapter.rank, slot)
        return loaded

    def unload_adapter(self, name: str) -> LoadedAdapter:
        """Stop serving ``name``: new requests are refused at once; those running finish with it."""
        adapter = self.adapters.remove(name)
        log.info("LoRA adapter %r unloaded (%d requests still finishing with it)", name,
                 self.adapters.in_use(adapter.id))
        return adapter

    # -- introspection ----------------------------------------------------
    def usage(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "blocks_total": self.block_manager.num_blocks,
            "blocks_used": self.block_manager.num_blocks - self.block_manager.num_free,
            "preemptions": self.scheduler.num_preemptions,
            **self.block_manager.usage(),
            **(self.speculator.usage() if self.speculator is not None else {}),
            **self.stats,
        }

    @property
    def caches(self) -> list:
        """Rank 0's KV cache (all of it at tp=1)."""
        return self.runner.caches

    def close(self) -> None:
        self.executor.close()
        if self.draft is not None:
            self.draft.close()
        self.seqs.clear()


def _prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[dict[int, float]]:
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


def _joined_masks(seqs: list[Sequence], masks: dict[Sequence, tuple[list[int], torch.Tensor]],
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


def _generates(seq: Sequence) -> bool:
    """Whether the sequence samples tokens: not an embedding request, nor a prompt scored alone."""
    return seq.pooling is None and seq.gen_config.max_new_tokens > 0
