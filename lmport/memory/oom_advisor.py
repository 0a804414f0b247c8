"""The OOM advisor: when the KV cache does not fit, the budget with numbers and the steps to try, in order.

``lmport.memory.budget`` raises ``CacheDoesNotFit`` with this advice (docs/memory.md).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from lmport.dtypes import torch_dtype
from lmport.models.parameters import count_parameters
from lmport.parallel import tp_choices, tp_problem
from lmport.units import ceil_div, fmt_bytes

if TYPE_CHECKING:
    from lmport.memory.budget import MemoryInputs


def advise(inp: MemoryInputs, problem: str, available: int | None = None) -> str:
    """The OOM advisor: ``problem``, the budget, then the steps to try in order, computed for these inputs.

    ``available``: free bytes measured after an allocation failed; advice then aims at 90% of it.
    """
    c, layout = inp.config, inp.layout
    bpb, bs = layout.bytes_per_block, layout.block_size
    count = c.cache_max_entry_count
    limit = inp.model_limit
    target = min(c.session_len, limit) if c.session_len else limit   # the session the user wants
    need = ceil_div(target, bs)
    if inp.window_blocks is not None:   # the blocks behind every layer's window are freed
        need = min(need, inp.window_blocks)
    fit = inp.layout.blocks_in(inp.usable_bytes)     # the most blocks there is memory for
    if available is not None:   # an allocation failed: aim at 90% of what is free now, and below what failed
        fit = min(layout.blocks_in(0.9 * (available - inp.reserve_bytes)), int(0.9 * inp.cache_blocks()))
    too_big = inp.cache_blocks() > fit

    lines = [problem + ".",
             f"Budget on {c.device_type}: {fmt_bytes(inp.free_bytes)} free with the weights loaded "
             f"({fmt_bytes(inp.weight_bytes)}), activation reserve {fmt_bytes(inp.reserve_bytes)} "
             f"({'measured' if inp.reserve_measured else 'estimated'}) for max_prefill_token_num="
             f"{c.max_prefill_token_num}, {fmt_bytes(inp.usable_bytes)} left for the KV cache; one block of {bs} "
             f"tokens is {fmt_bytes(bpb)} (quant_policy={c.quant_policy!r}); session_len {target} needs {need} blocks"
             + (f"; {fmt_bytes(available)} free after the failed allocation." if available is not None else "."),
             "Try, in order:",
             "1. cache_max_entry_count: " + _step_count(inp, count, too_big, fit, need, target)]

    base = inp   # what steps 2-5 change
    if isinstance(count, float) and not too_big and need > layout.blocks_in(inp.usable_bytes):
        # Step 1 cannot reach session_len alone: show the others at the backend's default share at least.
        base = inp.changed(cache_max_entry_count=max(count, inp.capabilities.default_cache_max_entry_count))
        lines[-1] += f"; steps 2-5 assume cache_max_entry_count={base.config.cache_max_entry_count}"
    blocks = min(base.cache_blocks(), fit)        # what a cache that fits gets
    memory = blocks * bpb
    quant = []
    for q in ("fp8", 8, 4):   # fp8 first where the device keeps it: a value a byte, no scale or zero a row
        if _bits(q) >= _bits(c.quant_policy) or (q == "fp8" and not inp.capabilities.runs_kv_policy(q)):
            continue
        if not inp.capabilities.runs_kv_policy(q):
            quant.append(f"quant_policy={q} is not supported on {c.device_type} "
                         f"(it supports {sorted(inp.capabilities.kv_quant_policies)})")
        elif memory < 1:
            quant.append(f"quant_policy={q} cannot help while no memory is left for the cache")
        else:
            bpb_q = inp.changed(quant_policy=q).layout.bytes_per_block
            quant.append(f"quant_policy={q!r}: {bpb / bpb_q:.2f}x the tokens: {fmt_bytes(memory)} holds "
                         f"{memory // bpb_q:,} blocks ({memory // bpb_q * bs:,} tokens) instead of {blocks:,}")
    lines.append("2. " + ("; ".join(quant) if quant else f"quant_policy is already {c.quant_policy}, the smallest"))
    lines.append("3. max_prefill_token_num: " + _step_prefill(base, need))
    if blocks < 1:
        lines.append("4. session_len cannot help until the cache gets a block (steps 1-3)")
    else:
        at = f" at cache_max_entry_count={base.config.cache_max_entry_count}" if base is not inp else ""
        lines.append(f"4. session_len: lower it to <= {blocks * bs:,} (what {blocks:,} blocks hold{at}"
                     f"{', with step 1' if too_big else ''})")
    # The tp values the config splits, and why the checkpoint refuses each (None: it splits too).
    refusals = {n: _checkpoint_refuses(inp, n) for n in tp_choices(inp.model_config) if n > c.tp}
    bigger = [n for n, refused in refusals.items() if refused is None]
    if bigger:
        alt = base.changed(tp=bigger[0])
        lines.append(f"5. tp={bigger[0]} ({bigger[0]} devices like this one): each holds {fmt_bytes(alt.weight_bytes)} "
                     f"of weights and {alt.layout.num_kv_heads} of {inp.model_config.num_key_value_heads} KV heads: "
                     f"{_room_text(alt)}")
    elif refusals:   # the config splits, the checkpoint's weights do not
        lines.append(f"5. tp: no tp above {c.tp} splits this checkpoint ({next(iter(refusals.values()))})")
    elif c.tp < inp.model_config.num_attention_heads:   # a larger tp exists but cannot split this model
        lines.append(f"5. tp: no tp above {c.tp} splits this model (tp={c.tp + 1}: "
                     f"{tp_problem(inp.model_config, c.tp + 1)})")
    else:
        lines.append(f"5. tp={c.tp} already splits all {inp.model_config.num_key_value_heads} KV heads")
    lines.append("6. weights: " + _step_weights(base))
    return "\n".join(lines)


def _checkpoint_refuses(inp: MemoryInputs, tp: int) -> str | None:
    """Why the checkpoint's weights cannot be split over ``tp`` ranks although its config can (a GGUF's quantized
    weights, or its experts' blocks: lmport.weights.checkpoint.check_tensor_parallel); None when they can, or the
    checkpoint is not known."""
    from lmport.errors import ConfigError
    from lmport.weights.checkpoint import check_tensor_parallel
    if inp.checkpoint is None:
        return None
    try:
        check_tensor_parallel(inp.checkpoint, tp, inp.config.weight_format)
    except ConfigError as err:
        return str(err)
    return None


def _bits(quant_policy: int | str) -> int:
    """Bits a KV value takes under ``quant_policy`` (0: a 16-bit cache's, the most any step proposes from)."""
    return 16 if quant_policy == 0 else 8 if quant_policy == "fp8" else int(quant_policy)


def _step_weights(inp: MemoryInputs) -> str:
    """What a 4-bit checkpoint of this model would free (docs/weight-quantization.md), when the loaded one is float."""
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
            f"{fmt_bytes(inp.weight_bytes)} ({inp.config.dtype}), {fmt_bytes(saved)} more for the cache: "
            f"{_room_text(alt)}")


def _room_text(inp: MemoryInputs) -> str:
    n, bs = inp.room_blocks(), inp.layout.block_size
    if isinstance(inp.config.cache_max_entry_count, int):
        return f"room for {n:,} blocks ({n * bs:,} tokens)"
    return f"{n:,} blocks ({n * bs:,} tokens) at cache_max_entry_count={inp.config.cache_max_entry_count}"


def _step_prefill(inp: MemoryInputs, need: int) -> str:
    """The largest halving of max_prefill_token_num that gives ``need`` blocks; else what halving gains."""
    tokens = inp.config.max_prefill_token_num
    if tokens == 1:
        return "already 1"

    def works(x: MemoryInputs) -> bool:
        return x.room_blocks() >= need and x.cache_blocks() * x.layout.bytes_per_block <= x.usable_bytes

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
