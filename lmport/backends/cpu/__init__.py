"""cpu backend: host memory; C++ kernels (kernels.py) for paged attention, KV fill, small-batch
linear, linear over int4/int8 weights and over GGUF block weights, RMSNorm, rotary and the
silu-gated activation on float32, the gated delta rule token by token (Gated DeltaNet's decode), the
reference ops for everything else."""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

from lmport import ops
from lmport.ops import gated_delta_net
from lmport.platform.backend import Backend, Capabilities, ProbeResult
from lmport.backends.cpu import kernels, malloc
from lmport.backends.cpu.decoder_runner import build as build_decoder_runner
from lmport.kv.layout import LayerCache
from lmport.weights import interleaved

# Up to this many tokens (a decode step) the compiled small-batch linear beats the
# BLAS, which is tuned for large batches; prefill GEMMs stay with the BLAS, except over quantized
# rows held interleaved (hold_quantized) where the build's integer kernels run a prefill faster than a
# GEMM over the weight expanded to float32 (AVX-512 VNNI: the build's interleaved_prefill(); measured by
# `lmport bench kernels cpu --only held`); past it, those kernels take AMX tiles where asked for
# (LMPORT_CPU_PREFILL=bf16; csrc/interleaved_rows.h's kDecodeRows is this count).
SMALL_BATCH_TOKENS = 128


class CpuBackend(Backend):
    capabilities = Capabilities(
        device_type="cpu",
        torch_device="cpu",
        kv_quant_policies=frozenset({0, 4, 8}),
        kv_cache_dtypes=frozenset({"float16"}),   # a float32 model's K and V in half the bytes
        kv_fp8_formats=frozenset({"e4m3"}),       # on the reference ops (kernels.cache_takes leaves fp8 to them)
        weight_formats=frozenset({"int4", "int8"}),
        ggml_types=kernels.GGML_TYPES,
        default_block_size=16,
        dist_backend="gloo",
        priority=0,
        default_dtype="float32",
        # Host RAM is shared with everything else on the machine: take a smaller share.
        default_cache_max_entry_count=0.05,
        lora=True,
        # sinks and chunks in the compiled paged attention, bidirectional spans on the reference op, latent (MLA)
        # on lmport.ops.mla, recurrent state (Gated DeltaNet): its decode in the compiled gated delta rule, its
        # prefill on the chunked reference op
        attention_variants=frozenset({"sinks", "chunked", "latent", "recurrent_state", "bidirectional"}),
    )

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "always available (host memory)")

    @classmethod
    def setup_rank(cls, local_rank: int, local_world: int) -> str:
        # Every rank computes on host memory; the cores are split so ranks do not oversubscribe them.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
        return "cpu"

    def __init__(self, device=None) -> None:
        super().__init__(device)
        malloc.keep_freed_memory()

    def release_idle_memory(self) -> None:
        malloc.give_back_freed_memory()   # what glibc kept for the steps (malloc.keep_freed_memory)

    def prepare(self) -> None:
        # The compiled kernels are built on their first use in a source version (a compiler of about 2 GB for
        # a minute): at load, not inside the first request.
        kernels.load()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        small = x.dim() == 2 and x.shape[0] <= SMALL_BATCH_TOKENS and kernels.small_linear_takes(x.shape[1])
        compiled = _compiled_for(x, weight, *([] if bias is None else [bias])) if small else None
        if compiled is not None:
            return compiled.small_linear(x, weight, bias)
        if x.dim() == 2 and x.shape[0] > SMALL_BATCH_TOKENS and x.dtype == weight.dtype == torch.float32:
            return prefill_gemm(x, weight, bias)
        return super().linear(x, weight, bias)

    def quant_linear(self, x: torch.Tensor, weight: ops.QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        compiled = _compiled_for(x, *([] if bias is None else [bias]))
        if compiled is None or x.dim() != 2:
            return super().quant_linear(x, weight, bias)
        q = weight
        if runs_compiled(compiled, q, x.shape[0]):
            return compiled.quant_linear(x, q.qweight, q.scales, kernels.kernel_mins(q), q.bits, q.group_size, bias,
                                         row_group=q.row_group)
        # prefill: the weight expanded once for a GEMM, which is then as fast as on float weights
        return prefill_gemm(x, self.expanded(q), bias)

    def ggml_linear(self, x: torch.Tensor, weight: ops.GGMLWeight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        compiled = _compiled_for(x, *([] if bias is None else [bias]))
        if compiled is None or weight.type_name not in self.capabilities.ggml_types:
            return super().ggml_linear(x, weight, bias)
        x2 = x.reshape(-1, weight.in_features)
        if runs_compiled(compiled, weight, x2.shape[0]):
            y = compiled.ggml_linear(x2, weight.blocks, weight.type_name, weight.in_features, bias,
                                     row_group=weight.row_group)
        else:  # prefill: the weight expanded once for a GEMM
            y = prefill_gemm(x2, self.expanded(weight), bias)
        return y.view(*x.shape[:-1], weight.out_features)

    def prefill_expands(self, weight: ops.QuantizedWeight | ops.GGMLWeight) -> bool:
        """Whether a prefill (more than SMALL_BATCH_TOKENS float32 rows) over ``weight`` runs a GEMM over it
        expanded (``expanded``), as quant_linear and ggml_linear pick, rather than the build's group kernels or
        the reference op."""
        compiled = kernels.load()
        if compiled is None or (weight.row_group != 1 and compiled.interleaved_prefill()):
            return False
        return isinstance(weight, ops.QuantizedWeight) or weight.type_name in self.capabilities.ggml_types

    def expanded(self, weight: ops.QuantizedWeight | ops.GGMLWeight) -> torch.Tensor:
        """``weight`` as the float32 matrix a prefill's GEMM runs on (where ``prefill_expands``)."""
        compiled = kernels.load()
        if isinstance(weight, ops.QuantizedWeight):
            return compiled.quant_dequantize(weight.qweight, weight.scales, weight.mins, weight.bits,
                                             weight.group_size, row_group=weight.row_group)
        return compiled.ggml_dequantize(weight.blocks, weight.type_name, weight.in_features, row_group=weight.row_group)

    def recurrent_gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, state: torch.Tensor | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
        if kernels.load() is None:
            return super().recurrent_gated_delta_rule(q, k, v, g, beta, state)
        b, hv, dk, dv = q.shape[0], v.shape[-2], k.shape[-1], v.shape[-1]
        after = q.new_zeros(b, hv, dk, dv, dtype=torch.float32) if state is None else state.float().clone()
        out = self.recurrent_gated_delta_rule_in_place(q, k, v, g, beta, after, torch.arange(b))
        return out, after

    def recurrent_gated_delta_rule_in_place(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                            g: torch.Tensor, beta: torch.Tensor, pool: torch.Tensor,
                                            slots: torch.Tensor) -> torch.Tensor:
        compiled = kernels.load()
        if compiled is None or pool.dtype != torch.float32 or not pool.is_contiguous():
            return super().recurrent_gated_delta_rule_in_place(q, k, v, g, beta, pool, slots)
        out = compiled.recurrent_gated_delta_rule(*gated_delta_net.heads_first(q, k, v, g, beta), pool, slots)
        return out.transpose(1, 2).to(v.dtype).contiguous()

    def quant_embedding(self, ids: torch.Tensor, weight: ops.QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        compiled = kernels.load() if dtype == torch.float32 else None
        if compiled is None:
            return super().quant_embedding(ids, weight, dtype)
        rows = compiled.quant_dequantize(weight.qweight, weight.scales, weight.mins, weight.bits, weight.group_size,
                                         rows=ids.reshape(-1), row_group=weight.row_group)
        return rows.view(*ids.shape, weight.in_features)

    def ggml_embedding(self, ids: torch.Tensor, weight: ops.GGMLWeight, dtype: torch.dtype) -> torch.Tensor:
        compiled = kernels.load() if dtype == torch.float32 else None
        if compiled is None or weight.type_name not in self.capabilities.ggml_types:
            return super().ggml_embedding(ids, weight, dtype)
        rows = compiled.ggml_dequantize(weight.blocks, weight.type_name, weight.in_features, rows=ids.reshape(-1),
                                        row_group=weight.row_group)
        return rows.view(*ids.shape, weight.in_features)

    def hold_quantized(self, weight: ops.QuantizedWeight | ops.GGMLWeight,
                       dtype: torch.dtype) -> ops.QuantizedWeight | ops.GGMLWeight:
        """Rows interleaved in groups of 16 for the formats the kernels' decode reads so
        (csrc/interleaved_rows.h: on the AVX-512 and the AVX2 path), where float32 activations reach the kernels;
        relaid in place where torch owns the tensors (``weight`` is not to be used after)."""
        compiled = kernels.load() if dtype == torch.float32 else None
        if compiled is None or weight.row_group != 1 or weight.out_features < interleaved.GROUP:
            return weight
        if isinstance(weight, ops.QuantizedWeight):
            held = weight.bits in compiled.quant_interleaved_bits()
        else:
            held = weight.type_name in compiled.ggml_interleaved_types()
        return interleaved.interleave(weight, in_place=True, kernel=compiled.interleave_groups) if held else weight

    def hold_experts(self, experts: ops.QuantizedExperts, dtype: torch.dtype) -> ops.QuantizedExperts:
        """Each stacked weight as ``hold_quantized`` holds a linear's where every expert's rows are whole groups (a
        group straddling two experts would belong to neither)."""
        held = {name: self.hold_quantized(w, dtype) for name in ("gate", "up", "down")
                if (w := getattr(experts, name)).out_features // experts.num_experts % interleaved.GROUP == 0}
        return dataclasses.replace(experts, **held)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        compiled = _compiled_for(x, weight)
        if compiled is None:
            return super().rms_norm(x, weight, eps)
        return compiled.rms_norm(x, weight, eps)

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        compiled = _compiled_for(q, k, cos, sin)
        if compiled is None:
            return super().apply_rotary(q, k, cos, sin)
        return compiled.apply_rotary(q, k, cos, sin)

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        compiled = _compiled_for(gate, up)
        if compiled is None:
            return super().silu_and_mul(gate, up)
        return compiled.silu_and_mul(gate, up)

    def fused_moe(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() <= MOE_GATHER_PAIRS:
            return moe_by_gather(x, gate_up, down, weights, ids)
        return super().fused_moe(x, gate_up, down, weights, ids)

    def quantized_moe(self, x: torch.Tensor, experts: ops.QuantizedExperts, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        # Every expert in one call over GGUF blocks the kernels run, where the loop would run each expert's tokens
        # through the compiled ggml_linear (runs_compiled); else the loop, each expert through a GEMM.
        stacked = (experts.gate, experts.up, experts.down)
        compiled = _compiled_for(x) if x.dim() == 2 else None
        if compiled is None or not all(isinstance(w, ops.GGMLWeight) and w.type_name in self.capabilities.ggml_types
                                       and runs_compiled(compiled, w, x.shape[0]) for w in stacked):
            return super().quantized_moe(x, experts, weights, ids)
        gate, up, down = ((w.blocks, w.type_name, w.row_group) for w in stacked if isinstance(w, ops.GGMLWeight))
        alpha, limit = experts.clamp or (None, None)
        return compiled.ggml_experts(x, ids, weights.float(), experts.num_experts, *gate, *up, *down,
                                     biases=experts.biases, alpha=alpha, limit=limit,
                                     scale_inputs=experts.scale_inputs)

    def hold_heads(self, weight: ops.QuantizedWeight | ops.GGMLWeight, heads: int,
                   dtype: torch.dtype) -> ops.QuantizedWeight | ops.GGMLWeight:
        """As ``hold_quantized`` holds a linear's, where each head's rows are whole groups."""
        if weight.out_features // heads % interleaved.GROUP:
            return weight
        return self.hold_quantized(weight, dtype)

    def head_linear(self, x: torch.Tensor,
                    weight: torch.Tensor | ops.QuantizedWeight | ops.GGMLWeight) -> torch.Tensor:
        # Every head in one call over GGUF blocks, where the loop would run each head through the compiled
        # ggml_linear (runs_compiled).
        compiled = _compiled_for(x) if isinstance(weight, ops.GGMLWeight) else None
        if compiled is None or weight.type_name not in self.capabilities.ggml_types or \
                not runs_compiled(compiled, weight, x.shape[0]):
            return super().head_linear(x, weight)
        y = compiled.ggml_head_linear(x.transpose(0, 1), weight.blocks, weight.type_name, weight.in_features,
                                      row_group=weight.row_group)
        return y.transpose(0, 1)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 batch: ops.LoraBatch) -> torch.Tensor:
        # Each adapter's rows as one gather, two GEMMs and one scatter-add: the work is GEMMs, which the BLAS
        # already runs at its best, and a step with k adapters costs 4k torch calls, not one a row.
        for slot, rows in batch.rows_by_slot:
            update = torch.nn.functional.linear(torch.nn.functional.linear(x.index_select(0, rows), lora_a[slot]),
                                                lora_b[slot])
            y.index_add_(0, rows, update)
        return y

    def decoder_runner(self, layers: list[ops.DecoderLayerSpec]) -> ops.DecoderRunner | None:
        compiled = kernels.load()
        return None if compiled is None else build_decoder_runner(layers, compiled, SMALL_BATCH_TOKENS, prefill=self)

    def fill_kv_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                      slot_mapping: torch.Tensor) -> None:
        # The kernel covers the caches kernels.cache_takes names, in this backend's bshd order.
        compiled = _compiled_for(k, v) if kernels.cache_takes(cache) else None
        if compiled is None:
            return super().fill_kv_cache(k, v, cache, slot_mapping)
        if cache.quant_policy:
            return compiled.fill_kv_cache_codes(k, v, cache.k, cache.v, cache.k_qparams, cache.v_qparams,
                                                cache.quant_policy, slot_mapping)
        compiled.fill_kv_cache(k, v, cache.k, cache.v, slot_mapping)

    def paged_attention(self, q: torch.Tensor, cache: LayerCache, meta: ops.AttentionMetadata,
                        softmax_scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # The kernel covers the caches kernels.cache_takes names (in this backend's bshd order), head dims as
        # attention_takes says.
        # Windows, soft caps, sinks and chunks run on it; bidirectional spans on the reference op.
        fits = kernels.attention_takes(q.shape[-1]) and kernels.cache_takes(cache) and meta.bidirectional is None
        compiled = _compiled_for(q) if fits else None
        if compiled is None:
            return super().paged_attention(q, cache, meta, softmax_scale, new_kv)
        step = (meta.block_tables, meta.q_start_loc, meta.kv_lens, softmax_scale, meta.window or 0, meta.softcap or 0.0)
        variants = {"sinks": meta.sinks, "chunk": meta.chunk or 0}
        if cache.quant_policy == 0:
            return compiled.paged_attention(q.contiguous(), cache.k, cache.v, *step, **variants)
        # The step's own tokens attend to their K and V as computed, not to their codes (lmport.ops.attention).
        k_new, v_new = (None, None) if new_kv is None else (t.float() for t in new_kv)
        return compiled.paged_attention_codes(q.contiguous(), cache.k, cache.v, cache.k_qparams, cache.v_qparams,
                                              cache.quant_policy, *step, k_new=k_new, v_new=v_new, **variants)


def runs_compiled(compiled, weight: ops.QuantizedWeight | ops.GGMLWeight, rows: int) -> bool:
    """Whether ``rows`` float32 rows of x over ``weight`` go to the compiled quant_linear / ggml_linear (a decode
    step, or a prefill over held rows where the build's group kernels beat the GEMM) rather than to a GEMM over the
    weight expanded."""
    return rows <= SMALL_BATCH_TOKENS or (weight.row_group != 1 and compiled.interleaved_prefill())


# Up to this many (token, expert) pairs the cpu MoE gathers each pair's expert weights and runs one
# batched matmul (decode); above it the experts run one after another on their tokens (prefill).
MOE_GATHER_PAIRS = 16


def prefill_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T (+ bias) in float32 for more rows than a decode step (a float weight, or a quantized one just
    expanded): by oneDNN's matmul where torch has it, which runs these GEMMs faster than torch's default
    BLAS (MKL) on the AMD EPYCs measured (`lmport bench kernels cpu --only prefill`); the same sums in
    another order. Under LMPORT_CPU_PREFILL=bf16 on a CPU with bfloat16 products (kernels.bf16_gemm) oneDNN's
    bfloat16 math mode: x and w rounded to bfloat16 as the GEMM reads them, the products summed in float32, the
    result float32 (torch's CPU GEMM over bfloat16 tensors returns bfloat16)."""
    if not kernels.bf16_gemm():
        return _float32_gemm(x, w, bias)
    matmul = torch.backends.mkldnn.matmul
    before, matmul.fp32_precision = matmul.fp32_precision, "bf16"
    try:
        return _float32_gemm(x, w, bias)
    finally:
        matmul.fp32_precision = before


def _float32_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    onednn = onednn_linear()
    if onednn is None:
        return torch.nn.functional.linear(x, w, bias)
    return onednn(x, w, bias, "none", [], "")


@functools.cache
def onednn_linear():
    """oneDNN's fused linear (the op torch.compile's CPU code calls) where this torch build has it and it
    answers as F.linear does on a small case; None otherwise (the op is not part of torch's public API)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None:
        return None
    x, w, b = torch.arange(32.0).view(2, 16), torch.ones(3, 16), torch.arange(3.0)
    try:
        same = torch.equal(op(x, w, b, "none", [], ""), torch.nn.functional.linear(x, w, b))
    except (RuntimeError, TypeError):
        return None
    return op if same else None


def moe_by_gather(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The routed experts of every (token, expert) pair at once: their weights gathered, then two
    batched matmuls, no loop in Python; for a few pairs, where the reference's per-expert passes cost
    more in dispatch than in arithmetic."""
    t, k = ids.shape
    flat = ids.flatten()
    xs = x.repeat_interleave(k, dim=0)[:, :, None]                  # [P, hidden, 1]
    gate, up = torch.bmm(gate_up.index_select(0, flat), xs)[..., 0].chunk(2, dim=-1)
    y = torch.bmm(down.index_select(0, flat), (torch.nn.functional.silu(gate) * up)[:, :, None])[..., 0]
    return (y.float() * weights.reshape(-1, 1)).view(t, k, -1).sum(1).to(x.dtype)


def _compiled_for(*tensors: torch.Tensor):
    """The compiled kernels when every tensor is float32 (all they take), else None."""
    for t in tensors:   # a loop, not all(): this runs a few hundred times a decode step
        if t.dtype != torch.float32:
            return None
    return kernels.load()
