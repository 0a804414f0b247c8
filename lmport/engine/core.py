"""The engine core: token ids in, token ids out.

``EngineCore`` is synchronous (``add_request`` / ``step`` / ``abort``). A step schedules a batch
(lmport.sched.scheduler), has the worker run it and make token ids of it (lmport.worker.model_step: the forward,
the grammar masks, sampling, speculative verification), and has the scheduler update the sequences from that
output (append, stop, free). Its outputs carry token ids and no text: the in-process LLM (lmport.engine.llm) gives
them their text, and under ``lmport serve`` the front end does (lmport.engine.core_process, lmport.engine.client).
Every request ends finished ("stop" / "length"), aborted, or with an error.
"""
from __future__ import annotations

import itertools
import logging
import uuid
from typing import cast

import torch

from lmport.platform.backend import Backend
from lmport.config import ConfigError, EngineConfig, GenerationConfig
from lmport.dtypes import torch_dtype
from lmport.engine.outputs import Failure, FinishReason, RequestError, RequestOutput, check_prompt
from lmport.engine.pooling import POOLING_MODES
from lmport.executor.local import make_executor
from lmport.structured_output.grammar import Grammars, GuidedDecodingError, MaskBuilder
from lmport.kv.layout import KVLayout
from lmport.lora.peft import read_peft_adapter
from lmport.lora.table import AdapterTable, LoadedAdapter
from lmport.memory.budget import CachePlan, MemoryInputs
from lmport.models.loader import read_model_config, resolve_model_path
from lmport.models.lora import LoraLayers
from lmport.models.windows import kv_window, layer_windows
from lmport.multimodal.inputs import ImageInput, check_placement, images_key
from lmport.multimodal.processor import VISION_MODEL_TYPES
from lmport.kv import host_tier
from lmport.kv.block_manager import BlockManager
from lmport.kv.prefix_cache import model_fingerprint
from lmport.parallel import check_tp
from lmport.platform.resolution import resolve_config
from lmport.worker.runner import ModelRunner
from lmport.sched.output import ModelOutput, Update
from lmport.kv.state_pool import StatePool
from lmport.models.architectures import attention_variants, recurrent_state
from lmport.sched.scheduler import ScheduledBatch, Scheduler
from lmport.sched.sequence import Sequence
from lmport.speculative.draft import DraftModel, check_draft
from lmport.speculative.speculator import Speculator
from lmport.units import fmt_bytes
from lmport.weights.checkpoint import check_backend, check_tensor_parallel
from lmport.worker.model_step import ModelStep

log = logging.getLogger(__name__)

SCORING_LOGITS_BUDGET = 64 * 2**20   # bytes of float32 logits one step may hold for a prompt's logprobs


class EngineCore:
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
        if spec is not None and recurrent_state(read_model_config(model), self.dtype) is not None:
            raise ConfigError(f"speculative decoding is not supported for {read_model_config(model).model_type}: its "
                              f"linear-attention layers' state would already hold a rejected proposal's tokens; "
                              f"run it without speculative")
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
        # Structured outputs (docs/engine.md): grammars compiled once per format, masks built beside the forward.
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.masks = MaskBuilder(self.model_config.vocab_size)
        # Prompt positions a step may score: their float32 logits stay within SCORING_LOGITS_BUDGET.
        self.scoring_chunk = max(1, min(SCORING_LOGITS_BUDGET // (4 * self.model_config.vocab_size),
                                        self.config.max_prefill_token_num))
        self.adapters = AdapterTable(self.config.max_loras)   # LoRA adapters (docs/lora.md)
        # Speculative decoding (docs/speculative.md): the scheduler reserves slots for each proposal.
        self.speculator = None
        if self.config.speculative is not None:
            self.speculator = Speculator(self.config.speculative, self.session_len,
                                         lambda: len(self.scheduler.running), self.draft)
            self.scheduler.lookahead = self.speculator.lookahead
        self.scheduler.session_len, self.scheduler.accept_budget = self.session_len, self.masks.budget
        # The worker side of a step: forward, masks, sampling, verification (token ids out).
        self.worker = ModelStep(self.executor, self.masks, self.adapters, bool(self.config.max_loras))

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
        hybrid = recurrent_state(cfg, self.dtype) is not None   # linear-attention layers keep a state (state_pool)
        if hybrid and num_host_blocks:
            log.warning("the host tier is off: %s's linear-attention layers keep a state a swapped-out sequence "
                        "would come back without; preempted sequences are recomputed", cfg.model_type)
            num_host_blocks = 0
        self.executor.run_all("allocate", num_blocks, num_host_blocks)
        log.info("memory plan (each of %d ranks): weights %s, activation reserve %s (%s), cache %s = %d blocks x %d "
                 "tokens (quant_policy %s), session_len %d", self.config.tp, fmt_bytes(loaded.weight_bytes),
                 fmt_bytes(self.plan.reserve_bytes),
                 "measured" if self.memory_inputs.reserve_measured else "estimated",
                 fmt_bytes(self.plan.cache_bytes), self.plan.num_blocks, self.layout.block_size,
                 self.config.quant_policy, self.session_len)

        # Prefix cache and host tier: docs/prefix-caching.md. Where every layer slides, the blocks behind the
        # window are freed as sequences grow (lmport.kv.window); a prefix's early blocks then outlive no
        # holder and the cache keeps losing chains' heads, so prefix caching is off there (docs/engine.md).
        window = kv_window(cfg)
        prefix_caching = self.config.enable_prefix_caching and window is None and not hybrid
        if self.config.enable_prefix_caching and hybrid:
            log.warning("prefix caching is off: %s's linear-attention layers keep a state after a prefix, which the "
                        "prefix cache does not store (docs/engine.md)", cfg.model_type)
        elif self.config.enable_prefix_caching and not prefix_caching:
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
        self.scheduler.context_cost = context_cost(cfg, self.config.tp * loaded.num_parameters)
        self.scheduler.whole_images = "bidirectional" in attention_variants(cfg)   # an image's tokens see each other
        if hybrid:   # one recurrent-state slot for each of max_batch_size running sequences, as the runner holds
            self.scheduler.state_pool = StatePool(self.config.max_batch_size)

    # -- requests --------------------------------------------------------
    def add_request(self, prompt_ids: list[int], gen_config: GenerationConfig | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, adapter: str | None = None,
                    pooling: str | None = None, scoring_chunk: int | None = None,
                    images: list[ImageInput] | None = None, group: str | None = None) -> str:
        """Queue a request; raises RequestError (and queues nothing) for input it cannot serve.
        ``adapter``: the name of a loaded LoRA adapter to run it with (AdapterError when none is loaded so).
        ``pooling``: an embedding request ("mean" or "last", lmport.engine.pooling): the prompt is prefilled with the
        other requests' steps, nothing is generated, and its final output carries the pooled hidden state.
        ``scoring_chunk``: prompt positions a step may score (gen_config.prompt_logprobs), at most the engine's
        ``scoring_chunk`` by default. ``images``: the prompt's images (lmport.multimodal.processor makes them), each
        on its run of placeholder tokens. ``group``: the client request it is one of several sequences of (choices,
        prompts): when blocks run out, the request running the most sequences yields one first."""
        gen_config = gen_config or GenerationConfig()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids)
        if images or self.model_config.model_type in VISION_MODEL_TYPES:   # no stray placeholder either
            self.check_images(list(images or []), prompt_ids)
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
                       adapter_id=adapter_id, pooling=pooling, images=list(images or []),
                       images_key=images_key(images) if images else None, group=group)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(prompt_ids)
        return request_id

    def check_images(self, images: list[ImageInput], prompt_ids: list[int]) -> None:
        """RequestError unless the model takes images and they sit on the prompt's placeholder tokens."""
        cfg = self.model_config
        if cfg.model_type not in VISION_MODEL_TYPES:
            raise RequestError(f"model {self.model_name!r} takes no images (it is a {cfg.model_type!r} text model); "
                               f"send text only, or serve a vision-language model ({', '.join(VISION_MODEL_TYPES)})")
        if self.speculator is not None:
            raise RequestError("images with speculative decoding are not supported yet; serve the model without "
                               "--speculative-config to send it images")
        try:
            check_placement(images, prompt_ids, cfg.image_token_id)
        except ValueError as exc:
            raise RequestError(f"images: {exc}") from None

    def validate(self, prompt_ids) -> None:
        if self.failure:
            raise RequestError(f"the engine cannot run the model: {self.failure}")
        check_prompt(prompt_ids, self.model_config.vocab_size, self.session_len)

    def abort(self, request_id: str) -> bool:
        """End a request; its last output comes with the next step's."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self._end(seq, FinishReason.ABORT)
        self._pending_outputs.append(self._output(seq, [], []))
        return True

    def finish_request(self, request_id: str, reason: FinishReason, failure: Failure | None = None) -> None:
        """End a request its caller has finished (a stop string in its text, text that could not be decoded:
        lmport.engine.output_processor); no output of it follows."""
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self._end(seq, reason, failure)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    # -- one step --------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute (the worker runs the forward and samples, grammar masks and speculative verification
        included: token ids out), update the sequences from that output (append, stop, free). Each output carries
        a request's new token ids and logprobs, no text."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.failure:   # a rank is gone: nothing can run, and every request ends with why
            return outputs + [self._end(s, FinishReason.ERROR, Failure(self.failure)) for s in list(self.seqs.values())]
        batch = self.scheduler.schedule()
        self.stats["steps"] += bool(batch)
        timing = self._decode_timing(batch)
        self._propose(batch)
        output = self.worker.execute(batch)
        updates = self.scheduler.update_from_output(batch, output)
        outputs += [self._report(batch, output, update) for update in updates]
        if timing is not None:
            self._observe(timing, batch, updates)
        if output.failure is not None and self.failure:   # the forward failed as a rank died: end the rest too
            outputs += self.step()
        return outputs

    def _propose(self, batch: ScheduledBatch) -> None:
        """Speculative decoding: the tokens each decoding sequence with reserved slots verifies this step, and the
        draft probabilities they were drawn from; its ``num_new`` shrinks to what was proposed (and the blocks
        reserved past it are given back)."""
        if self.speculator is None or not batch:
            return
        slots = {seq: n - 1 for seq, n in zip(batch.seqs, batch.num_new)
                 if n > 1 and seq.num_uncomputed == 1 and seq.pooling is None}
        proposals, batch.draft_probs = self.speculator.proposals(slots)
        for i, seq in enumerate(batch.seqs):
            if seq in slots and len(proposals.get(seq, ())) < slots[seq]:
                batch.num_new[i] = 1 + len(proposals.get(seq, ()))
                self.block_manager.rollback(seq, seq.num_computed + batch.num_new[i])
        batch.proposals = {s: p for s, p in proposals.items() if p}

    def _decode_timing(self, batch: ScheduledBatch) -> float | None:
        """When a decode step starts, if the speculator judges from such steps whether verifying proposals pays
        (lmport.speculative.speculator.Payoff); else None."""
        payoff = self.speculator.payoff if self.speculator is not None else None
        if payoff is None or not batch or not all(s.num_uncomputed == 1 and s.pooling is None for s in batch.seqs):
            return None
        return payoff.clock()

    def _observe(self, started: float, batch: ScheduledBatch, updates: list[Update]) -> None:
        payoff = cast(Speculator, self.speculator).payoff
        payoff.observe(len(batch.seqs), sum(batch.num_new) > len(batch.seqs),
                       sum(len(u.token_ids) for u in updates), payoff.clock() - started)

    def _report(self, batch: ScheduledBatch, output: ModelOutput, update: Update) -> RequestOutput:
        """One sequence's output of the step; the speculator records its verified proposal; a request that ended
        is dropped."""
        seq = update.seq
        accepted = output.seqs[seq].accepted if seq in output.seqs else None
        if accepted is not None:
            cast(Speculator, self.speculator).record(seq, len(batch.proposals[seq]), accepted)
        self.stats["generated_tokens"] += len(update.token_ids)
        if seq.is_finished:
            self._forget(seq)
        return self._output(seq, update.token_ids, update.logprobs, update.embedding)

    def _end(self, seq: Sequence, reason: FinishReason, failure: Failure | None = None) -> RequestOutput:
        """End a request here (not from a step's output); its final output."""
        self.scheduler.end(seq, reason, failure)
        self._forget(seq)
        return self._output(seq, [], [])

    def _forget(self, seq: Sequence) -> None:
        """What the core keeps of a request that ended, dropped."""
        if self.speculator is not None:
            self.speculator.forget(seq)
        self.adapters.release(seq.adapter_id)
        self.seqs.pop(seq.request_id, None)

    def _output(self, seq: Sequence, new_tokens: list[int], new_logprobs: list,
                embedding: list[float] | None = None) -> RequestOutput:
        """The core's output: the new token ids and their logprobs, no text (lmport.engine.output_processor). The
        prompt's logprobs come on the first output with tokens, the prompt being scored by then (a stop string
        may end the request before the core does), and on the finished one."""
        first = bool(new_tokens) and len(seq.output_ids) == len(new_tokens)
        scored = seq.gen_config.prompt_logprobs is not None and (seq.is_finished or first)
        return RequestOutput(
            request_id=seq.request_id, token_ids=[], text="", delta_token_ids=new_tokens, delta_text="",
            finished=seq.is_finished, finish_reason=seq.finish_reason, prompt_tokens=len(seq.prompt_ids),
            cached_tokens=seq.num_cached_prefix, error=seq.error, delta_logprobs=new_logprobs,
            prompt_logprobs=seq.prompt_logprobs if scored else None, embedding=embedding, error_kind=seq.error_kind)

    @property
    def failure(self) -> str | None:
        """Why the model cannot run any more (a tensor-parallel rank died or raised), else None."""
        return self.executor.failure

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


def context_cost(cfg, num_parameters: int) -> float:
    """A prompt token's attention work per position of context before it, in units of its other work (2 FLOPs
    a weight it is multiplied by: every weight but the embedding table, a lookup, and an untied LM head, which
    only a prompt's last token goes through): 4 FLOPs a head dimension (q.k, and the weighted sum of v) for every
    head of each layer that attends to the whole context (a sliding window's or a linear-attention layer's work
    is bounded). Every expert of an MoE counts, so its cost is low. 0 for a config that does not say (chunks are
    then sized in tokens alone)."""
    try:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        full = sum(w is None and t not in ("linear_attention", "chunked_attention")
                   for w, t in zip(layer_windows(cfg), types))
        tables = cfg.vocab_size * cfg.hidden_size * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 0.0
    weights = num_parameters - tables
    return 4 * full * heads * head_dim / (2 * weights) if weights > 0 else 0.0
