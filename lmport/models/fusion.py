"""Projections that read the same input, merged into one linear once the weights are loaded: an
attention layer's q, k and v, and an MLP's gate and up.

A decode step at batch 1 is a string of small matmuls, each paying a fixed cost besides the bytes
of weight it reads (the call, the threads, a quantized kernel's pass over the activations); merging
leaves 4 calls a layer instead of 7. The merged weight stacks the parts' rows in order
(under tensor parallelism, this rank's rows of each), so its output splits back into theirs exactly.
Parts of different kinds (float beside quantized, int4 beside int8, other group sizes or GGUF block
types) become a ``ConcatLinear`` that calls each run of neighbouring parts of one kind as one weight (a
Q4_K_M file's q and k in Q5_0 beside v in Q8_0: two calls, not three); parts with and without a bias stay
separate.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport.models.layers import Linear, RowParallelLinear, linear_weights
from lmport.models.llama import MLP, Attention
from lmport.models.quantized import GGMLLinear, QuantLinear
from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import GGMLWeight
from lmport.weights.residency import page_out


def merge_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear computing ``torch.cat([p(x) for p in parts], -1)``: one weight where the parts are of one
    kind, else a ConcatLinear; None where some parts have a bias and others not, or float dtypes differ."""
    biases = [p.bias for p in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    merged = _one_weight(parts, _stacked(biases))
    if merged is not None:
        return merged
    float_dtypes = {p.weight.dtype for p in parts if isinstance(p, Linear)}
    if len(float_dtypes) <= 1 and all(linear_weights(p) is not None for p in parts):
        return ConcatLinear(_runs_merged(parts, biases))
    return None


def _runs_merged(parts: list[nn.Module], biases: list) -> list[nn.Module]:
    """``parts`` with each run of neighbours that stack into one weight as that weight (the longest run from
    each part on)."""
    out, start = [], 0
    while start < len(parts):
        for end in range(len(parts), start, -1):
            merged = parts[start] if end == start + 1 else _one_weight(parts[start:end], _stacked(biases[start:end]))
            if merged is not None:
                break
        out.append(merged)
        start = end
    return out


def _stacked(biases: list) -> torch.Tensor | None:
    """The parts' biases end to end (all present, or all None: then None)."""
    return None if biases[0] is None else torch.cat([b.detach() for b in biases])


def _one_weight(parts: list[nn.Module], bias: torch.Tensor | None) -> nn.Module | None:
    """The parts' weights stacked into one linear of their kind, or None where they differ in kind."""
    if all(isinstance(p, QuantLinear) for p in parts):
        weights = [p.quantized for p in parts]
        if len({(w.bits, w.group_size, w.in_features) for w in weights}) != 1:
            return None
        merged = QuantizedWeight(*(torch.cat([getattr(w, f) for w in weights]) for f in ("qweight", "scales", "mins")),
                                 weights[0].bits, weights[0].group_size, all(w.zero_mins for w in weights))
        return QuantLinear(merged, bias, parts[0].backend)
    if all(isinstance(p, GGMLLinear) for p in parts):
        blocks = [p.quantized for p in parts]
        if len({(w.type_name, w.in_features) for w in blocks}) != 1:
            return None
        merged = GGMLWeight(torch.cat([w.blocks for w in blocks]), blocks[0].type_name, blocks[0].in_features)
        return GGMLLinear(merged, bias, parts[0].backend)
    if all(type(p) is not RowParallelLinear and isinstance(p, Linear) for p in parts):
        weights = [p.weight.detach() for p in parts]
        if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
            return None
        with torch.device("meta"):   # no throwaway initialization of a weight about to be replaced
            fused = Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias is not None, parts[0].backend)
        fused.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias, requires_grad=False)
        return fused
    return None


class ConcatLinear(nn.Module):
    """Parts of different kinds (a Q4_K_M file's q and k in one block type, v in another) as one linear:
    still one module to call, and one entry in a decoder runner's layer spec, each part in its own format."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.forward(x) for p in self.parts], -1)


# Module class: (the merged linear's attribute, its parts' attributes in row order).
MERGES = {Attention: ("qkv_proj", ["q_proj", "k_proj", "v_proj"]), MLP: ("gate_up_proj", ["gate_proj", "up_proj"])}


def fuse_projections(model: nn.Module) -> int:
    """Merge q/k/v and gate/up in every attention layer and MLP of ``model``; the number of merges."""
    merges = 0
    for module in list(model.modules()):
        for kind, (merged_name, part_names) in MERGES.items():
            if not isinstance(module, kind) or getattr(module, merged_name) is not None:
                continue
            parts = [getattr(module, name) for name in part_names]
            fused = merge_linears(parts)
            if fused is None:
                continue
            setattr(module, merged_name, fused)
            for name in part_names:
                delattr(module, name)
            kept = set(fused.modules())   # a ConcatLinear's parts that are not stacked run as they are
            page_out([t for p in parts if p not in kept for t in [*p.parameters(), *p.buffers()]])
            merges += 1
    return merges
