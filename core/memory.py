"""Memory planning: weights, activation reserve and KV cache, and advice with numbers when the cache does not fit.

``plan_cache`` sizes the cache from a ``MemoryInputs`` for both the engine (free
memory measured once the weights are loaded) and ``lmport plan`` (free memory
computed from a device size, no weights loaded), so the two always agree.
The semantics are documented in docs/memory.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lmport.backend import Capabilities
from lmport.config import ConfigError, EngineConfig
from lmport.dtypes import torch_dtype
from lmport.kv.layout import KVLayout
from lmport.models.llama import head_dim_of
from lmport.parallel import check_tp, kv_heads_per_rank, tp_choices
from lmport.units import GiB, ceil_div, fmt_bytes

# get_ppl keeps each chunk's float32 logits under this (LMDeploy's limit too).
PPL_LOGITS_BUDGET = 2 * GiB


class CacheDoesNotFit(ConfigError):
    """The KV cache does not fit on the device; the message lists what to change, with numbers."""


def model_limit(model_cfg) -> int:
    """The longest sequence the engine runs: the model's context, or its sliding attention window if
    that is shorter (Mistral v0.1, Qwen2 with use_sliding_window). The paged kernels attend to the
    whole history, which within one window is exactly what the window would compute."""
    limit = getattr(model_cfg, "max_position_embeddings", None) or 1 << 30
    window = getattr(model_cfg, "sliding_window", None)  # transformers sets None where no layer slides
    return min(limit, window) if window else limit


def kv_layout(model_cfg, config: EngineConfig, axis_order: str = "bshd") -> KVLayout:
    """The KV layout of one device: tensor parallelism splits the KV heads over ``config.tp`` devices
    (and replicates them where tp exceeds the KV heads)."""
    check_tp(model_cfg, config.tp)
    return KVLayout(num_layers=model_cfg.num_hidden_layers, num_kv_heads=kv_heads_per_rank(model_cfg, config.tp),
                    head_dim=head_dim_of(model_cfg), block_size=config.block_size,
                    dtype=torch_dtype(config.dtype), quant_policy=config.quant_policy, axis_order=axis_order)


def activation_reserve(model_cfg, config: EngineConfig) -> int:
    """Estimated peak activation bytes of one forward over ``max_prefill_token_num`` tokens (an upper estimate).

    The widest live tensors in a layer are the MLP's gate, up and product ([T, intermediate]
    each) beside the residual stream and q/k/v; tensor parallelism splits the MLP and the
    heads. Logits are computed only for the last token of each sequence (at most
    ``max_batch_size`` rows): the lm_head output, its float32 copy and sampling's copies.
    Attention kernels are assumed not to materialize [T, T] scores (flash-style).
    """
    dtype_bytes = torch_dtype(config.dtype).itemsize
    hidden, heads = model_cfg.hidden_size, model_cfg.num_attention_heads
    per_token = (3 * model_cfg.intermediate_size + 3 * heads * head_dim_of(model_cfg)) / config.tp + 4 * hidden
    tokens = config.max_prefill_token_num
    logits = min(config.max_batch_size, tokens) * model_cfg.vocab_size * (dtype_bytes + 3 * 4)
    return int((tokens * per_token * dtype_bytes + logits) * 1.25)


def measure_activation_reserve(runner) -> int | None:
    """Peak bytes of one real forward of ``runner`` (lmport.runner.ModelRunner) over ``max_prefill_token_num``
    tokens, where the backend can measure it (``Backend.measure_peak_memory``); None where it cannot (cpu):
    then the estimate is used. Under tensor parallelism every rank runs it together."""
    from lmport.runner import StepInput
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
        raise CacheDoesNotFit(
            f"one forward of max_prefill_token_num={tokens} tokens does not fit beside the weights "
            f"({fmt_bytes(free)} free): lower max_prefill_token_num (to {max(1, tokens // 4)}, say), "
            f"or use a larger tp (among {tp_choices(runner.model_config)})") from None
    # The scratch cache counts in the peak; the real cache is planned separately.
    return None if peak is None else max(0, peak - blocks * layout.bytes_per_block)


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the cache size depends on, for one model, device and resolved config."""

    model_config: object        # the transformers config
    config: EngineConfig        # resolved: block_size, dtype and cache_max_entry_count are set
    capabilities: Capabilities
    weight_bytes: int           # on one device
    free_bytes: int             # device memory free once the weights are loaded
    reserve_bytes: int          # activation reserve for one forward of max_prefill_token_num tokens
    reserve_measured: bool

    @property
    def layout(self) -> KVLayout:
        return kv_layout(self.model_config, self.config)

    @property
    def usable_bytes(self) -> int:
        """What the cache may take at most: free memory less the activation reserve."""
        return max(0, self.free_bytes - self.reserve_bytes)

    def changed(self, **fields) -> MemoryInputs:
        """These inputs with config fields changed; weights and reserve rescaled to match (for advice)."""
        new = dataclasses.replace(self.config, **fields)
        weights = self.weight_bytes * self.config.tp // new.tp
        scale = activation_reserve(self.model_config, new) / activation_reserve(self.model_config, self.config)
        return dataclasses.replace(self, config=new, weight_bytes=weights,
                                   free_bytes=self.free_bytes + self.weight_bytes - weights,
                                   reserve_bytes=int(self.reserve_bytes * scale))


@dataclass(frozen=True)
class CachePlan:
    free_bytes: int             # device memory free once the weights are loaded
    reserve_bytes: int          # activation reserve for one forward of max_prefill_token_num tokens
    reserve_measured: bool      # False: the estimate (the backend cannot measure)
    cache_bytes: int
    bytes_per_block: int
    block_size: int
    num_blocks: int
    session_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_sequence(self) -> int:
        return ceil_div(self.session_len, self.block_size)

    @property
    def max_sequences(self) -> int:
        """Sequences of the full session length the cache holds at once."""
        return self.num_blocks // self.blocks_per_sequence


def _blocks(inp: MemoryInputs) -> int:
    """Blocks the cache gets: a float is a share of the usable memory, an int an exact count."""
    count = inp.config.cache_max_entry_count
    if isinstance(count, int):
        return count
    return inp.layout.blocks_in(inp.usable_bytes * count)


def _room(inp: MemoryInputs) -> int:
    """Blocks that ``cache_max_entry_count`` can give: its share for a float, all the usable memory for an int."""
    if isinstance(inp.config.cache_max_entry_count, int):
        return inp.layout.blocks_in(inp.usable_bytes)
    return _blocks(inp)


def plan_cache(inp: MemoryInputs) -> CachePlan:
    """The cache size and session length; raises CacheDoesNotFit (with advice) when the cache cannot work."""
    layout, config = inp.layout, inp.config
    num_blocks = _blocks(inp)
    count = config.cache_max_entry_count
    if num_blocks * layout.bytes_per_block > inp.usable_bytes:   # only an exact block count can get here
        raise CacheDoesNotFit(advise(inp, f"cache_max_entry_count={count} blocks need "
                                          f"{fmt_bytes(num_blocks * layout.bytes_per_block)}, more than the "
                                          f"{fmt_bytes(inp.usable_bytes)} left after weights and activation reserve"))
    if num_blocks < 1:
        raise CacheDoesNotFit(advise(inp, f"the KV cache gets no block: cache_max_entry_count={count} of "
                                          f"{fmt_bytes(inp.usable_bytes)} is less than one "
                                          f"{fmt_bytes(layout.bytes_per_block)} block"))
    capacity = num_blocks * layout.block_size
    limit = model_limit(inp.model_config)
    if config.session_len is None:
        session_len = min(limit, capacity)
    else:
        session_len = min(config.session_len, limit)
        if session_len > capacity:
            raise CacheDoesNotFit(advise(inp, f"session_len={session_len} does not fit in the KV cache: "
                                              f"{num_blocks} blocks x {layout.block_size} = {capacity} tokens"))
    return CachePlan(inp.free_bytes, inp.reserve_bytes, inp.reserve_measured, num_blocks * layout.bytes_per_block,
                     layout.bytes_per_block, layout.block_size, num_blocks, session_len)


def allocate_cache(inp: MemoryInputs, plan: CachePlan, layout: KVLayout, backend) -> list:
    """``layout.allocate`` for the plan; an allocator failure becomes CacheDoesNotFit with advice."""
    try:
        return layout.allocate(plan.num_blocks, backend.device)
    except RuntimeError as exc:  # torch.OutOfMemoryError, or the cpu allocator's "can't allocate memory"
        if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in str(exc).lower():
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        problem = f"allocating the KV cache ({plan.num_blocks} blocks, {fmt_bytes(plan.cache_bytes)}) failed: {reason}"
    available, _ = backend.memory_info()   # outside the except block: the partial allocation is freed by now
    raise CacheDoesNotFit(advise(inp, problem, available=available))


def advise(inp: MemoryInputs, problem: str, available: int | None = None) -> str:
    """The OOM advisor: ``problem``, the budget, then the steps to try in order, computed for these inputs.

    ``available``: free bytes measured after an allocation failed; advice then aims at 90% of it.
    """
    c, layout = inp.config, inp.layout
    bpb, bs = layout.bytes_per_block, layout.block_size
    count = c.cache_max_entry_count
    limit = model_limit(inp.model_config)
    target = min(c.session_len, limit) if c.session_len else limit   # the session the user wants
    need = ceil_div(target, bs)
    fit = inp.layout.blocks_in(inp.usable_bytes)     # the most blocks there is memory for
    if available is not None:   # an allocation failed: aim at 90% of what is free now, and below what failed
        fit = min(layout.blocks_in(0.9 * (available - inp.reserve_bytes)), int(0.9 * _blocks(inp)))
    too_big = _blocks(inp) > fit

    lines = [problem + ".",
             f"Budget on {c.device_type}: {fmt_bytes(inp.free_bytes)} free with the weights loaded "
             f"({fmt_bytes(inp.weight_bytes)}), activation reserve {fmt_bytes(inp.reserve_bytes)} "
             f"({'measured' if inp.reserve_measured else 'estimated'}) for max_prefill_token_num="
             f"{c.max_prefill_token_num}, {fmt_bytes(inp.usable_bytes)} left for the KV cache; one block of {bs} "
             f"tokens is {fmt_bytes(bpb)} (quant_policy={c.quant_policy}); session_len {target} needs {need} blocks"
             + (f"; {fmt_bytes(available)} free after the failed allocation." if available is not None else "."),
             "Try, in order:",
             "1. cache_max_entry_count: " + _step_count(inp, count, too_big, fit, need, target)]

    base = inp   # what steps 2-5 change
    if isinstance(count, float) and not too_big and need > layout.blocks_in(inp.usable_bytes):
        # Step 1 cannot reach session_len alone: show the others at the backend's default share at least.
        base = inp.changed(cache_max_entry_count=max(count, inp.capabilities.default_cache_max_entry_count))
        lines[-1] += f"; steps 2-5 assume cache_max_entry_count={base.config.cache_max_entry_count}"
    blocks = min(_blocks(base), fit)        # what a cache that fits gets
    memory = blocks * bpb
    quant = []
    for q in (8, 4):
        if (q or 16) >= (c.quant_policy or 16):
            continue
        if q not in inp.capabilities.kv_quant_policies:
            quant.append(f"quant_policy={q} is not supported on {c.device_type} "
                         f"(it supports {sorted(inp.capabilities.kv_quant_policies)})")
        elif memory < 1:
            quant.append(f"quant_policy={q} cannot help while no memory is left for the cache")
        else:
            bpb_q = inp.changed(quant_policy=q).layout.bytes_per_block
            quant.append(f"quant_policy={q}: {bpb / bpb_q:.2f}x the tokens: {fmt_bytes(memory)} holds "
                         f"{memory // bpb_q:,} blocks ({memory // bpb_q * bs:,} tokens) instead of {blocks:,}")
    lines.append("2. " + ("; ".join(quant) if quant else f"quant_policy is already {c.quant_policy}, the smallest"))
    lines.append("3. max_prefill_token_num: " + _step_prefill(base, need))
    if blocks < 1:
        lines.append("4. session_len cannot help until the cache gets a block (steps 1-3)")
    else:
        lines.append(f"4. session_len: lower it to <= {blocks * bs:,} (what {blocks:,} blocks hold"
                     f"{' at cache_max_entry_count=' + str(base.config.cache_max_entry_count) if base is not inp else ''}"
                     f"{', with step 1' if too_big else ''})")
    bigger = [n for n in tp_choices(inp.model_config) if n > c.tp]
    if bigger:
        alt = base.changed(tp=bigger[0])
        lines.append(f"5. tp={bigger[0]} ({bigger[0]} devices like this one): each holds {fmt_bytes(alt.weight_bytes)} "
                     f"of weights and {alt.layout.num_kv_heads} of {inp.model_config.num_key_value_heads} KV heads: "
                     f"{_room_text(alt)}")
    else:
        lines.append(f"5. tp={c.tp} already splits all {inp.model_config.num_key_value_heads} KV heads")
    lines.append("6. weights: " + _step_weights(base))
    return "\n".join(lines)


def _step_weights(inp: MemoryInputs) -> str:
    """What a 4-bit checkpoint of this model would free (docs/weight-quantization.md), when the loaded one is float."""
    from lmport.plan import count_parameters
    params = count_parameters(inp.model_config)
    float_bytes = params * torch_dtype(inp.config.dtype).itemsize // inp.config.tp
    if inp.weight_bytes < 0.9 * float_bytes:
        return f"already quantized ({fmt_bytes(inp.weight_bytes)} for {params / 1e6:.0f}M parameters)"
    if "int4" not in inp.capabilities.weight_formats:
        return f"4-bit weights are not supported on {inp.config.device_type}"
    # int4 in groups of 32 with a float16 scale and min: 4 + 32 / 32 bits = 0.625 bytes a parameter.
    four_bit = params * 5 // 8 // inp.config.tp
    saved = inp.weight_bytes - four_bit
    alt = dataclasses.replace(inp, weight_bytes=four_bit, free_bytes=inp.free_bytes + saved)
    return (f"a 4-bit checkpoint (a Q4_0 / Q4_1 GGUF) holds them in {fmt_bytes(four_bit)} instead of "
            f"{fmt_bytes(inp.weight_bytes)} ({inp.config.dtype}), {fmt_bytes(saved)} more for the cache: {_room_text(alt)}")


def _room_text(inp: MemoryInputs) -> str:
    n, bs = _room(inp), inp.config.block_size
    if isinstance(inp.config.cache_max_entry_count, int):
        return f"room for {n:,} blocks ({n * bs:,} tokens)"
    return f"{n:,} blocks ({n * bs:,} tokens) at cache_max_entry_count={inp.config.cache_max_entry_count}"


def _step_prefill(inp: MemoryInputs, need: int) -> str:
    """The largest halving of max_prefill_token_num that gives ``need`` blocks; else what halving gains."""
    tokens = inp.config.max_prefill_token_num
    if tokens == 1:
        return "already 1"

    def works(x: MemoryInputs) -> bool:
        return _room(x) >= need and _blocks(x) * x.layout.bytes_per_block <= x.usable_bytes

    alt, first = inp, None
    while alt.config.max_prefill_token_num > 1:
        alt = alt.changed(max_prefill_token_num=alt.config.max_prefill_token_num // 2)
        first = first or alt
        if works(alt):
            break
    else:
        alt = first
    enough = "" if works(alt) else ", not enough alone"
    return (f"lower it from {tokens} to {alt.config.max_prefill_token_num}: about "
            f"{fmt_bytes(inp.reserve_bytes - alt.reserve_bytes)} less activation reserve, {_room_text(alt)}"
            f"{enough} (long prompts then prefill in more steps)")


def _step_count(inp: MemoryInputs, count, too_big: bool, fit: int, need: int, target: int) -> str:
    bpb, usable = inp.layout.bytes_per_block, inp.usable_bytes
    if too_big:
        if fit < 1:
            return "cannot help: there is no room for a single block (steps 2, 3, 5)"
        if isinstance(count, int):
            return f"lower it from {count} to {fit} blocks (the most that fit)"
        share = math.floor(fit * bpb / usable * 1000) / 1000
        if share <= 0:   # too small a share to write with 3 decimals
            return f"lower it from {count} to an exact count of {fit} blocks"
        return f"lower it from {count} to {share} (the share that fits)"
    if need > inp.layout.blocks_in(usable):
        return (f"cannot help: all of {fmt_bytes(usable)} holds {inp.layout.blocks_in(usable)} blocks, "
                f"fewer than the {need} that session_len {target} needs")
    if isinstance(count, int):
        return f"raise it from {count} to {need} blocks (session_len {target})"
    return f"raise it from {count} to {min(1.0, math.ceil(need * bpb / usable * 1000) / 1000)} (session_len {target})"


def logits_chunk_tokens(vocab_size: int, budget_bytes: int = PPL_LOGITS_BUDGET) -> int:
    """Positions a chunk may score so that its [positions, vocab] float32 logits stay within the budget."""
    positions = budget_bytes // (vocab_size * 4)
    if positions < 1:
        raise ValueError(f"a logits budget of {budget_bytes} bytes is less than one position "
                         f"({vocab_size} x 4 bytes)")
    return positions
