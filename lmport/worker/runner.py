"""The model runner: one rank's model shard, KV-cache shard, attention metadata, block copies and forward.

The engine's driver (scheduler, block manager, sampling, detokenizing) never touches
the model's tensors: it hands the runner one ``StepInput`` a step, made of plain
Python lists, so under tensor parallelism it crosses the process boundary once a step
(lmport.executor.local) and every rank builds the same metadata from it.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import cast

import torch

from lmport.memory import budget as memory
from lmport.platform.backend import Backend, DecodeGraphs
from lmport.config import EngineConfig
from lmport.dtypes import torch_dtype
from lmport.models.architectures import recurrent_state
from lmport.models.loader import load_model, resolve_model_path
from lmport.models.lora import LoraLayers
from lmport.ops import build_attention_metadata, build_lora_batch, host_tensor
from lmport.kv import host_tier
from lmport.kv.state_pool import StateTensors
from lmport.parallel import TPGroup, tp_choices
from lmport.worker.sampling import rows_of
from lmport.units import ceil_div, fmt_bytes

log = logging.getLogger(__name__)


@dataclass
class StepInput:
    """One forward: the new tokens of each sequence, flattened, and what the attention needs."""

    token_ids: list[int]
    q_lens: list[int]                 # new tokens of each sequence
    kv_lens: list[int]                # tokens in each sequence's cache after this step
    block_tables: list[list[int]]
    logits_rows: list[int]            # rows of token_ids whose logits are wanted, ascending
    copies: list = field(default_factory=list)   # device<->host block copies (CopyBatch) to run first
    adapter_slots: list[int] = field(default_factory=list)   # each sequence's LoRA slot, -1 for none; [] for none
    pool_ranges: list[tuple[int, int]] = field(default_factory=list)   # rows whose final hidden states are summed
    state_slots: list[int] = field(default_factory=list)   # each sequence's recurrent-state slot; [] for none
    # each sequence's images (lmport.multimodal.inputs.ImageInput: pixel values for those whose tokens the step
    # computes, the layout alone for the others); [] when no sequence of the step has images
    images: list[list] = field(default_factory=list)


class ModelRunner:
    """One rank's part of the model. At tp=1 it lives in the engine's process and is called directly."""

    def __init__(self, model: str, config: EngineConfig, backend: Backend, tp: TPGroup | None = None):
        self.config, self.backend, self.model_name = config, backend, model
        self.tp = tp or TPGroup()
        self.dtype = torch_dtype(config.dtype)
        self.loaded = load_model(model, backend, self.dtype, self.tp, config.weight_format, config.mmproj)
        self.model, self.model_config = self.loaded.model, self.loaded.config
        backend.prepare()
        # LoRA adapters' slots (docs/lora.md), wrapped around the projections before the first forward.
        self.lora = (LoraLayers(self.model, config.max_loras, config.max_lora_rank, self.dtype)
                     if config.max_loras else None)
        self.lora_bytes = self.lora.bytes if self.lora is not None else 0
        self.layout = memory.kv_layout(self.model_config, config, backend.capabilities.kv_axis_order)
        self.caches: list = []
        self.host_caches: list = []
        self.memory_inputs: memory.MemoryInputs | None = None
        self.plan: memory.CachePlan | None = None
        self.graphs: DecodeGraphs | None = None   # captured decode steps (eager_mode=False), once allocated
        self.states: StateTensors | None = None   # linear-attention layers' state slots (lmport.kv.state_pool)

    # -- memory (docs/memory.md) --------------------------------------------
    def plan_memory(self) -> int:
        """Plans this rank's cache from its own free memory; returns the blocks it would get."""
        measured = measure_activation_reserve(self)
        free, _ = self.backend.memory_info()
        self.memory_inputs = memory.MemoryInputs(
            self.model_config, self.config, self.backend.capabilities, self.loaded.weight_bytes + self.lora_bytes, free,
            measured if measured is not None else memory.activation_reserve(self.model_config, self.config),
            measured is not None, memory.draft_bytes_per_block(self.config), resolve_model_path(self.model_name))
        self.plan = memory.plan_cache(self.memory_inputs)
        return self.plan.num_blocks

    def allocate(self, num_blocks: int, num_host_blocks: int) -> None:
        """Allocates ``num_blocks`` (every rank gets the smallest count any rank planned) and the host pool."""
        if num_blocks != self.plan.num_blocks:
            exact = dataclasses.replace(self.config, cache_max_entry_count=num_blocks)
            self.memory_inputs = dataclasses.replace(self.memory_inputs, config=exact)
            self.plan = memory.plan_cache(self.memory_inputs)
        self.caches = memory.allocate_cache(self.memory_inputs, self.plan, self.layout, self.backend)
        spec = recurrent_state(self.model_config, self.dtype)
        if spec is not None:   # one slot for each running sequence, planned beside the cache (memory.state_bytes)
            self.states = StateTensors(spec, self.config.max_batch_size, self.backend.device)
            self.model.bind_states(self.states)
        pin = self.backend.pin_host_memory()
        self.host_caches = (host_tier.allocate_host_pool(self.layout, num_host_blocks, pin_memory=pin)
                            if num_host_blocks else [])
        host_reader = next((type(m).__name__ for m in self.model.modules() if getattr(m, "reads_on_host", False)),
                           None)
        if not self.config.eager_mode and host_reader is not None:
            log.warning("decode steps run eagerly, not as CUDA graphs: %s reads device values on the host",
                        host_reader)
        elif not self.config.eager_mode and spec is None:
            # The resolved config keeps eager_mode=False only where the backend captures (resolve_config). A model
            # with recurrent-state layers splits each step by its sequences' lengths on the host, which a captured
            # step does not carry: it runs every step eagerly.
            self.graphs = self.backend.decode_graphs(
                self.decode_step, self.config.max_batch_size,
                ceil_div(self.plan.session_len, self.layout.block_size), self.layout.block_size)

    # -- a step -------------------------------------------------------------
    def copy_blocks(self, copies: list) -> None:
        """Block copies the block manager queued (device and host pools), in order, one call per batch."""
        pools = {"device": self.caches, "host": self.host_caches}
        for b in copies:
            src, dst = pools[b.source], pools[b.target]
            self.backend.copy_blocks(src, dst, torch.tensor(b.src, dtype=torch.long),
                                     torch.tensor(b.dst, dtype=torch.long))

    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Block copies, then the forward over the cache; the logits rows (rank 0; None elsewhere)."""
        self.copy_blocks(step.copies)
        if not step.q_lens:
            return None
        if (self.graphs is not None and max(step.q_lens) == 1 and step.logits_rows and not step.images
                and self.graphs.takes(len(step.q_lens), max(map(len, step.block_tables)))):
            meta = build_attention_metadata(step.q_lens, step.kv_lens, step.block_tables, self.layout.block_size,
                                            self.backend.device)
            logits = self.graphs.run(host_tensor(step.token_ids, torch.long).to(self.backend.device), meta)
            return logits[step.logits_rows]   # a copy: the replayed output is overwritten by the next run
        return self.forward(step, self.caches)

    def decode_step(self, input_ids: torch.Tensor, meta) -> torch.Tensor:
        """One decode forward over this rank's cache, every row's logits: what ``Backend.decode_graphs`` captures."""
        # Graphs are captured at tp=1 only (lmport.platform.resolution), where the LM head always returns the logits.
        return cast(torch.Tensor, self.model.logits(self.model(input_ids, meta, self.caches)))

    def execute_pooled(self, step: StepInput) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``execute`` that also returns, for each of ``step.pool_ranges``, the float32 sum of the final hidden
        states (after the last norm) of those rows [ranges, hidden] (embeddings: lmport.engine.pooling)."""
        self.copy_blocks(step.copies)
        hidden = self.hidden_states(step, self.caches)
        sums = torch.stack([hidden[a:b].float().sum(0) for a, b in step.pool_ranges])
        logits = self.model.logits(rows_of(hidden, step.logits_rows)) if step.logits_rows else hidden.new_empty(0)
        return logits, sums

    def forward(self, step: StepInput, caches: list) -> torch.Tensor | None:
        hidden = self.hidden_states(step, caches)
        if not step.logits_rows:
            return hidden.new_empty(0) if self.tp.rank == 0 else None
        return self.model.logits(rows_of(hidden, step.logits_rows))

    def hidden_states(self, step: StepInput, caches: list) -> torch.Tensor:
        """The step's final hidden states [tokens, hidden], its K/V written to ``caches``."""
        device = self.backend.device
        meta = build_attention_metadata(step.q_lens, step.kv_lens, step.block_tables, self.layout.block_size, device)
        input_ids = host_tensor(step.token_ids, torch.long).to(device)
        if self.states is not None:
            self.model.state_slots = step.state_slots or None
        if getattr(self.model, "takes_images", False):   # read by its next forward (lmport.models.qwen2_vl)
            self.model.step_images = (step.images, step.q_lens, step.kv_lens) if step.images else None
        if self.lora is None:
            hidden = self.model(input_ids, meta, caches)
        else:
            self.lora.state.batch = (build_lora_batch(step.q_lens, step.adapter_slots, device)
                                     if step.adapter_slots else None)
            try:
                hidden = self.model(input_ids, meta, caches)
            finally:
                self.lora.state.batch = None
        return hidden

    # -- LoRA adapters (docs/lora.md) ------------------------------------------
    def load_adapter(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` of every LoRA layer holds this adapter (module -> (A, B scaled)); its other modules zero."""
        device = self.backend.device
        cast(LoraLayers, self.lora).load(slot, {k: (a.to(device), b.to(device)) for k, (a, b) in weights.items()})

    def allocation(self) -> dict:
        """What this rank really holds: weight bytes, KV-cache blocks and bytes, and the recurrent-state slots'
        bytes of a hybrid model (0 for others) (compared with `lmport plan`)."""
        tensors = [t for c in self.caches for t in (c.k, c.v, c.k_qparams, c.v_qparams) if t is not None]
        return {"weight_bytes": self.loaded.weight_bytes, "lora_bytes": self.lora_bytes,
                "num_blocks": self.caches[0].k.shape[0] if self.caches else 0,
                "cache_bytes": sum(t.numel() * t.element_size() for t in tensors),
                "state_bytes": self.states.bytes if self.states is not None else 0}

    def barrier(self) -> None:
        """Returns once every rank has called it (lmport.parallel.TPGroup.barrier)."""
        self.tp.barrier()

    def close(self) -> None:
        self.caches, self.host_caches, self.graphs, self.states = [], [], None, None


def measure_activation_reserve(runner) -> int | None:
    """Peak bytes of one real forward of ``runner`` over ``max_prefill_token_num``
    tokens, where the backend can measure it (``Backend.measure_peak_memory``); None where it cannot (cpu):
    then the estimate is used. Under tensor parallelism every rank runs it together."""
    backend, layout, config = runner.backend, runner.layout, runner.config
    tokens = config.max_prefill_token_num
    blocks = ceil_div(tokens, layout.block_size)
    rows = min(config.max_batch_size, tokens)

    def forward():
        caches = layout.allocate(blocks, backend.device)   # a scratch cache just for this forward
        step = StepInput([0] * tokens, [tokens], [tokens], [list(range(blocks))], list(range(tokens - rows, tokens)))
        logits = runner.forward(step, caches)
        if logits is not None:
            logits.softmax(-1)

    try:
        peak = backend.measure_peak_memory(forward)
    except torch.OutOfMemoryError:
        free, _ = backend.memory_info()
        raise memory.CacheDoesNotFit(
            f"one forward of max_prefill_token_num={tokens} tokens does not fit beside the weights "
            f"({fmt_bytes(free)} free): lower max_prefill_token_num (to {max(1, tokens // 4)}, say), "
            f"or use a larger tp (among {tp_choices(runner.model_config)})") from None
    # The scratch cache counts in the peak; the real cache is planned separately.
    return None if peak is None else max(0, peak - blocks * layout.bytes_per_block)
