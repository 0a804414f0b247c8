"""The cpu backend's decoder runner (lmport.ops.decoder): a step's layers in one loop over the
compiled kernels, each layer's weights bound once.

Through the model's modules, a decode step of the default model makes about 400 op calls, each
through a module's forward, a backend method and its checks. At batch 1 that Python is a large
share of the step: the weights streaming through the caches between calls leave it running cold.
The runner makes the same kernel calls with nothing in between, in C++ (csrc/decoder_layers.h: one
call a step, the norms, rotary and residual adds done in place by the kernels' row functions, to the
same floats) or, with ``loop="python"``, in a Python loop over the kernels one by one (which a profile can
time op by op). It covers the steps the kernels cover as the
backend's methods would pick them (float32, a float32 cache or one of 8-/4-bit codes with float32 params, up to
SMALL_BATCH_TOKENS tokens).

Given the backend (``prefill``), it runs the longer steps (a prefill) too, through the backend's methods, the
calls the modules make, with one difference: the MLP runs on slices of at most MLP_SLICE_TOKENS rows, as
llama.cpp's ``n_ubatch`` bounds a batch's activations. The MLP's intermediate (gate and up: twice the
intermediate size a token, three times that while they are activated) is the largest tensor of a step, and
glibc keeps the heap a step's peak grew (lmport.backends.cpu.malloc), so it set the engine's memory after a
long step. The slices give the modules' floats: every slice is longer than SMALL_BATCH_TOKENS, so the backend
picks the kernels it picks for the whole step, and those give a row the same sums whatever rows are beside it
(oneDNN's GEMM on the machines tested: tests/test_prefill_slices.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmport import ops
from lmport.backends.cpu import kernels
from lmport.kv.layout import LayerCache
from lmport.platform.backend import Backend

if TYPE_CHECKING:
    from lmport.backends.cpu import CpuBackend

Layer = Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor], LayerCache, ops.AttentionMetadata], torch.Tensor]


# A prefill step's MLP runs on slices of at most this many rows (llama.cpp's default n_ubatch); more than
# twice SMALL_BATCH_TOKENS, so that every slice of a longer step is longer than a decode step.
MLP_SLICE_TOKENS = 512


def build(layers: list[ops.DecoderLayerSpec], compiled, small_batch_tokens: int,
          loop: str = "native", prefill: CpuBackend | None = None) -> ops.DecoderRunner | None:
    """The runner over ``layers`` with the compiled kernels, or None where a layer has a tensor
    they do not take. ``loop``: "native" (the layers in C++, one call a step) or "python".
    ``prefill``: the backend whose methods run the steps longer than ``small_batch_tokens`` (the MLP on slices:
    ``prefill_layer``); without it those steps go to the modules."""
    if not layers or not all(_fits(spec) for spec in layers):
        return None
    head_dim = layers[0].head_dim
    if prefill is not None and 2 * small_batch_tokens >= MLP_SLICE_TOKENS:
        raise ValueError(f"MLP slices of {MLP_SLICE_TOKENS} rows for decode steps of up to {small_batch_tokens} "
                         f"tokens: a step's last slice could be as short as a decode step and take its kernels")
    prefill_layers = None if prefill is None else [prefill_layer(spec, prefill) for spec in layers]

    def covers(x, ropes, caches) -> bool:
        cos, cache = ropes[0][0], caches[0]
        return not (x.shape[0] > small_batch_tokens or x.dtype != torch.float32 or cos.dtype != torch.float32
                    or cos.shape[-1] != head_dim or not kernels.cache_takes(cache))

    def run_prefill(x, ropes, caches, metas):
        if prefill_layers is None or x.shape[0] <= small_batch_tokens or x.dtype != torch.float32 \
                or ropes[0][0].shape[-1] != head_dim:
            return None
        for layer, rope, cache, meta in zip(prefill_layers, ropes, caches, metas, strict=True):
            x = layer(x, rope, cache, meta)
        return x

    if loop == "python":
        bound = [_bind_layer(spec, compiled) for spec in layers]

        def run_python(x, ropes, caches, metas):
            if not covers(x, ropes, caches):
                return run_prefill(x, ropes, caches, metas)
            for layer, rope, cache, meta in zip(bound, ropes, caches, metas, strict=True):
                x = layer(x, rope, cache, meta)
            return x

        return run_python
    if loop != "native":
        raise ValueError(f"decoder runner loop {loop!r}: 'native' or 'python'")
    native = compiled.DecoderLayers([_bind_layer_native(spec, compiled) for spec in layers])

    def run(x, ropes, caches, metas):
        if not covers(x, ropes, caches):
            return run_prefill(x, ropes, caches, metas)
        meta = metas[0]   # the layers share the metadata's tensors; only the window and soft cap differ
        rotary = [cos for cos, _ in ropes], [sin for _, sin in ropes]
        pools = [c.k for c in caches], [c.v for c in caches]
        step = (meta.slot_mapping, meta.block_tables, meta.q_start_loc, meta.kv_lens, [m.window or 0 for m in metas],
                [m.softcap or 0.0 for m in metas])
        if caches[0].quant_policy == 0:
            return native.run(x, *rotary, *pools, *step)
        params = [c.k_qparams for c in caches], [c.v_qparams for c in caches]
        return native.run_codes(x, *rotary, *pools, *params, caches[0].quant_policy, *step)

    return run


def _parts(linears: ops.Linears) -> tuple[ops.LinearWeights, ...]:
    return linears if isinstance(linears, tuple) else (linears,)


def _norms(spec: ops.DecoderLayerSpec) -> list[ops.Norm | None]:
    """The spec's norms in the order the C++ layer takes them (csrc/decoder_layers.h's BoundLayer)."""
    return [spec.attention_norm, spec.q_norm, spec.k_norm, spec.attention_output_norm, spec.mlp_norm,
            spec.mlp_output_norm]


def _fits(spec: ops.DecoderLayerSpec) -> bool:
    floats = [norm.weight for norm in _norms(spec) if norm is not None]
    for lw in (part for linears in (spec.qkv, spec.o, spec.gate_up, spec.down) for part in _parts(linears)):
        floats += [] if lw.bias is None else [lw.bias]
        if isinstance(lw.weight, ops.GGMLWeight):
            if lw.weight.type_name not in kernels.GGML_TYPES or lw.weight.blocks.device.type != "cpu":
                return False
        elif not isinstance(lw.weight, ops.QuantizedWeight):
            floats.append(lw.weight)
            if not kernels.small_linear_takes(lw.weight.shape[1]):
                return False
    on_cpu = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in floats)
    return on_cpu and kernels.attention_takes(spec.head_dim)


def _bind_linear(linears: ops.Linears, compiled) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(linears, tuple):   # parts of different formats, outputs concatenated
        parts = [_bind_linear(part, compiled) for part in linears]
        return lambda x: torch.cat([part(x) for part in parts], -1)
    weight, bias = linears.weight, linears.bias
    if isinstance(weight, ops.QuantizedWeight):
        qweight, scales, mins = weight.qweight, weight.scales, kernels.kernel_mins(weight)
        bits, group_size, row_group = weight.bits, weight.group_size, weight.row_group
        return lambda x: compiled.quant_linear(x, qweight, scales, mins, bits, group_size, bias, row_group=row_group)
    if isinstance(weight, ops.GGMLWeight):
        blocks, type_name, in_features = weight.blocks, weight.type_name, weight.in_features
        row_group = weight.row_group
        return lambda x: compiled.ggml_linear(x, blocks, type_name, in_features, bias, row_group=row_group)
    return lambda x: compiled.small_linear(x, weight, bias)


def _bind_linear_native(linears: ops.Linears, compiled) -> list:
    """A projection's parts as the C++ loop takes them (csrc/decoder_layers.h's BoundLinear)."""
    bound = []
    for part in _parts(linears):
        weight, bias = part.weight, part.bias
        if isinstance(weight, ops.QuantizedWeight):
            bound.append(compiled.BoundLinear("quant", weight.qweight, bias, weight.scales, kernels.kernel_mins(weight),
                                              weight.bits, weight.group_size, row_group=weight.row_group))
        elif isinstance(weight, ops.GGMLWeight):
            bound.append(compiled.BoundLinear("ggml", weight.blocks, bias, type=weight.type_name,
                                              in_features=weight.in_features, row_group=weight.row_group))
        else:
            bound.append(compiled.BoundLinear("float", weight, bias))
    return bound


def _bind_layer_native(spec: ops.DecoderLayerSpec, compiled):
    linear = [_bind_linear_native(lw, compiled) for lw in (spec.qkv, spec.o, spec.gate_up, spec.down)]
    norms = [compiled.BoundNorm(norm.weight, norm.eps) if norm is not None else None for norm in _norms(spec)]
    return compiled.BoundLayer(norms, linear[0], spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale,
                               linear[1], linear[2], linear[3], spec.activation == "gelu_tanh")


def _bind_norm(norm: ops.Norm | None, compiled) -> Callable[[torch.Tensor], torch.Tensor]:
    if norm is None:
        return lambda x: x
    weight, eps, rms_norm = norm.weight, norm.eps, compiled.rms_norm
    return lambda x: rms_norm(x, weight, eps)


def _bind_layer(spec: ops.DecoderLayerSpec, compiled) -> Layer:
    """One layer as lmport.ops.decoder describes it (the model's layer forward, op for op)."""
    qkv, o, gate_up, down = (_bind_linear(lw, compiled) for lw in (spec.qkv, spec.o, spec.gate_up, spec.down))
    norm, q_norm, k_norm, attention_out, mlp_norm, mlp_out = (_bind_norm(n, compiled) for n in _norms(spec))
    heads, head_dim, scale = [spec.num_heads, spec.num_kv_heads, spec.num_kv_heads], spec.head_dim, spec.scale
    rotary, fill, attention = compiled.apply_rotary, compiled.fill_kv_cache, compiled.paged_attention
    if spec.activation == "gelu_tanh":
        def gated(gate, up):
            return F.gelu(gate, approximate="tanh") * up
    else:
        gated = compiled.silu_and_mul

    def layer(x, rope, cache, meta):
        t = x.shape[0]
        # view, not unflatten: the compiled linears return contiguous rows; split_with_sizes, not
        # split: the same op without Tensor.split's Python wrapper.
        q, k, v = qkv(norm(x)).view(t, -1, head_dim).split_with_sizes(heads, 1)
        q, k = rotary(q_norm(q), k_norm(k), *rope)
        step = (meta.block_tables, meta.q_start_loc, meta.kv_lens, scale, meta.window or 0, meta.softcap or 0.0)
        if cache.quant_policy == 0:
            fill(k, v, cache.k, cache.v, meta.slot_mapping)
            out = attention(q, cache.k, cache.v, *step)
        else:
            params = cache.k_qparams, cache.v_qparams, cache.quant_policy
            compiled.fill_kv_cache_codes(k, v, cache.k, cache.v, *params, meta.slot_mapping)
            out = compiled.paged_attention_codes(q, cache.k, cache.v, *params, *step, k_new=k, v_new=v)
        x = x + attention_out(o(out.view(t, -1)))
        gate, up = gate_up(mlp_norm(x)).chunk(2, -1)
        return x + mlp_out(down(gated(gate, up)))

    return layer


def slices(rows: int, most: int) -> list[tuple[int, int]]:
    """[start, end) of ``rows`` in as few slices of at most ``most`` as can be, of lengths that differ by one at
    most (no short last slice)."""
    count = -(-rows // most)
    size, longer = divmod(rows, count)
    bounds, start = [], 0
    for i in range(count):
        end = start + size + (i < longer)
        bounds.append((start, end))
        start = end
    return bounds


def _backend_linear(linears: ops.Linears, backend: Backend) -> Callable[[torch.Tensor], torch.Tensor]:
    """A projection through the backend's method for its weight's kind, as the model's linear modules call it."""
    if isinstance(linears, tuple):   # parts of different formats, outputs concatenated (models.fusion.ConcatLinear)
        parts = [_backend_linear(part, backend) for part in linears]
        return lambda x: torch.cat([part(x) for part in parts], -1)
    weight, bias = linears.weight, linears.bias
    if isinstance(weight, ops.QuantizedWeight):
        return lambda x: backend.quant_linear(x, weight, bias)
    if isinstance(weight, ops.GGMLWeight):
        return lambda x: backend.ggml_linear(x, weight, bias)
    return lambda x: backend.linear(x, weight, bias)


def expanded_once(linears: ops.Linears, backend: CpuBackend) -> Callable[[torch.Tensor], torch.Tensor]:
    """The projection for one step's slices: a quantized weight the backend would expand for each slice's GEMM
    expanded here, once for all of them (the same GEMM on the same floats)."""
    if isinstance(linears, tuple):
        parts = [expanded_once(part, backend) for part in linears]
        return lambda x: torch.cat([part(x) for part in parts], -1)
    from lmport.backends.cpu import prefill_gemm   # the package imports this module first
    weight, bias = linears.weight, linears.bias
    if isinstance(weight, ops.QuantizedWeight | ops.GGMLWeight) and backend.prefill_expands(weight):
        matrix = backend.expanded(weight)
        return lambda x: prefill_gemm(x, matrix, bias)
    return _backend_linear(linears, backend)


def _backend_norm(norm: ops.Norm | None, backend: Backend) -> Callable[[torch.Tensor], torch.Tensor]:
    if norm is None:
        return lambda x: x
    return lambda x: backend.rms_norm(x, norm.weight, norm.eps)


def prefill_layer(spec: ops.DecoderLayerSpec, backend: CpuBackend) -> Layer:
    """One layer of a step longer than a decode step: the backend's methods, called as the model's modules call
    them, the MLP on slices of at most MLP_SLICE_TOKENS rows (its intermediate is never whole)."""
    qkv, o = (_backend_linear(lw, backend) for lw in (spec.qkv, spec.o))
    norm, q_norm, k_norm, attention_out, mlp_norm, mlp_out = (_backend_norm(n, backend) for n in _norms(spec))
    heads, head_dim, scale = [spec.num_heads, spec.num_kv_heads, spec.num_kv_heads], spec.head_dim, spec.scale
    if spec.activation == "gelu_tanh":
        def gated(gate, up):
            return F.gelu(gate, approximate="tanh") * up
    else:
        gated = backend.silu_and_mul

    def mlp(x, gate_up, down):
        gate, up = gate_up(mlp_norm(x)).chunk(2, -1)
        return mlp_out(down(gated(gate, up)))

    def attention(x, rope, cache, meta):
        q, k, v = qkv(norm(x)).unflatten(-1, (-1, head_dim)).split(heads, dim=1)
        q, k = backend.apply_rotary(q_norm(q), k_norm(k), *rope)
        backend.fill_kv_cache(k, v, cache, meta.slot_mapping)
        out = backend.paged_attention(q, cache, meta, scale, new_kv=(k, v))
        return attention_out(o(out.reshape(x.shape[0], -1)))

    def layer(x, rope, cache, meta):
        t = x.shape[0]
        x = x + attention(x, rope, cache, meta)   # its q, k, v freed before the MLP, as the modules' are
        summed = torch.empty_like(x)
        step_gate_up, step_down = expanded_once(spec.gate_up, backend), expanded_once(spec.down, backend)
        for start, end in slices(t, MLP_SLICE_TOKENS):
            torch.add(x[start:end], mlp(x[start:end], step_gate_up, step_down), out=summed[start:end])
        return summed

    return layer
