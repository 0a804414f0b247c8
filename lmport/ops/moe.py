"""Mixture of experts, reference: route each token to its top-k experts, then run each expert on its tokens.

Weights as transformers stores them: ``gate_up`` [experts, 2 * inter, hidden] (the gate's rows, then
the up projection's) and ``down`` [experts, hidden, inter]. Routing follows Mixtral and Qwen3-MoE
(``route``): softmax over the router logits in float32, the top k, renormalized to sum to 1 when the
model says so (Mixtral always; Qwen3-MoE when ``norm_topk_prob``); GLM-4.5's group-limited sigmoid
routing is ``route_grouped``, gpt-oss's softmax over the top k logits ``route_top_k_softmax`` (its
experts, with biases and a clamped SwiGLU, ``clamped_swiglu_moe``), Llama 4's sigmoid of the top k
``route_top_k_sigmoid`` (its experts, the weight scaling their input, ``input_scaled_moe``). Experts over
quantized weights as a GGUF stacks them (or an fp8 checkpoint's, stacked alike: lmport.weights.fp8) are described
by ``QuantizedExperts`` (run by ``Backend.quantized_moe``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmport.weights import row_range
from lmport.weights.format import QuantizedWeight
from lmport.weights.fp8 import Fp8Weight
from lmport.weights.ggml import GGMLWeight

Quantized = QuantizedWeight | GGMLWeight | Fp8Weight


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, experts] logits -> (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
                  top_groups: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited sigmoid routing (DeepSeek-V3, GLM-4.5): [T, experts] float32 logits -> (weights [T, k]
    float32, expert ids [T, k] int64).

    The experts are scored by sigmoid; the choice adds ``correction_bias`` to the scores, keeps the best
    ``top_groups`` of ``num_groups`` equal groups (a group ranked by the sum of its two best biased scores) and
    takes the top ``top_k`` experts inside them. Each chosen expert weighs its unbiased score, renormalized to sum
    to 1 when ``renormalize``, then times ``scaling``."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    grouped = choice.view(choice.shape[0], num_groups, -1)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    groups = group_scores.topk(top_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route_top_k_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top k logits, then a softmax over those k alone (in the logits' dtype)."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def clamped_swiglu_moe(x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                       down_bias: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, alpha: float,
                       limit: float) -> torch.Tensor:
    """gpt-oss's experts, in transformers' layout: ``gate_up`` [experts, hidden, 2 * inter] with the gate and up
    columns interleaved (gate even, up odd), ``down`` [experts, inter, hidden], each with a bias. An expert
    computes (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), then down."""
    def expert_mlp(expert: int, xs: torch.Tensor) -> torch.Tensor:
        h = xs @ gate_up[expert] + gate_up_bias[expert]
        return clamped_swiglu(h[..., ::2], h[..., 1::2], alpha, limit) @ down[expert] + down_bias[expert]

    return moe_by_expert(x, weights, ids, gate_up.shape[0], expert_mlp)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def route_top_k_sigmoid(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's routing: the top k logits, each through a sigmoid (in float32, returned in the logits' dtype)."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.sigmoid(values.float()).to(values.dtype), ids


def input_scaled_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts, in transformers' layout (``gate_up`` [experts, hidden, 2 * inter], the gate's columns
    then the up projection's; ``down`` [experts, inter, hidden]): sum over k of
    down_e(up_e(w x_t) * silu(gate_e(w x_t))), w = weights[t, k], e = ids[t, k]: the routing weight scales the
    expert's input, not its output."""
    def expert_mlp(expert: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = (xs @ gate_up[expert]).chunk(2, dim=-1)
        return (up * F.silu(gate)) @ down[expert]

    return moe_by_expert(x, weights, ids, gate_up.shape[0], expert_mlp, scale_inputs=True)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """sum over k of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]: [T, hidden].

    One pass an expert that has tokens (a loop over experts, never over tokens), as transformers does."""
    def expert_mlp(expert: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(xs, gate_up[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[expert])

    return moe_by_expert(x, weights, ids, gate_up.shape[0], expert_mlp)


def moe_by_expert(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                  expert_mlp: Callable[[int, torch.Tensor], torch.Tensor], scale_inputs: bool = False) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_mlp(ids[t, k], x_t): each expert that has tokens called once on
    all of them (``expert_mlp(e, x[tokens])`` -> [tokens, hidden]), the results summed in float32;
    ``scale_inputs``: sum over k of expert_mlp(ids[t, k], weights[t, k] * x_t) instead."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // ids.shape[1]
        w = weights.flatten()[pairs, None]
        if scale_inputs:
            out.index_add_(0, tokens, expert_mlp(expert, (x[tokens] * w).to(x.dtype)).float())
            continue
        y = expert_mlp(expert, x[tokens])
        out.index_add_(0, tokens, y.float() * w)
    return out.to(x.dtype)


@dataclass(frozen=True)
class QuantizedExperts:
    """A mixture of experts' routed experts over quantized weights as a GGUF stacks them: ``gate``, ``up`` and
    ``down`` each one weight of ``num_experts`` times an expert's rows (the experts' rows in turn, as
    ``ffn_{gate,up,down}_exps`` hold them), each of any kind (a Q4_K_M file's Q4_K gate and up, Q6_K down).
    An expert computes down(silu(gate x) * up x), with ``clamp`` (gpt-oss's alpha and limit) ``clamped_swiglu``
    in place of the silu; ``biases`` (gate's, up's and down's: [experts, rows] each, gpt-oss's) are added after
    each projection.
    ``scale_inputs``: the routing weight scales the expert's input, not its output (Llama 4)."""
    gate: Quantized
    up: Quantized
    down: Quantized
    num_experts: int
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    clamp: tuple[float, float] | None = None
    scale_inputs: bool = False

    @functools.cached_property
    def views(self) -> list[tuple[Quantized, Quantized, Quantized]]:
        """(gate, up, down) of each expert: views of its rows in the stacked weights, made once."""
        def rows(w: Quantized, e: int) -> Quantized:
            n = w.out_features // self.num_experts
            if isinstance(w, Fp8Weight):   # its scale rows are per block of rows
                return w.row_range(e * n, (e + 1) * n)
            return row_range(w, e * n, (e + 1) * n)

        return [(rows(self.gate, e), rows(self.up, e), rows(self.down, e)) for e in range(self.num_experts)]


def quantized_moe(x: torch.Tensor, experts: QuantizedExperts, weights: torch.Tensor, ids: torch.Tensor,
                  linear: Callable[[torch.Tensor, Quantized], torch.Tensor],
                  silu_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed experts ``experts`` describes, each that has tokens in turn (``moe_by_expert``), its projections
    by ``linear`` (x @ W^T for a quantized W) and its silu(gate) * up by ``silu_and_mul``: a backend's kernels."""
    def expert_mlp(expert: int, xs: torch.Tensor) -> torch.Tensor:
        gate_w, up_w, down_w = experts.views[expert]
        gate, up = linear(xs, gate_w), linear(xs, up_w)
        if experts.biases is not None:
            gate, up = gate + experts.biases[0][expert], up + experts.biases[1][expert]
        h = silu_and_mul(gate, up) if experts.clamp is None else clamped_swiglu(gate, up, *experts.clamp)
        out = linear(h, down_w)
        return out if experts.biases is None else out + experts.biases[2][expert]

    return moe_by_expert(x, weights, ids, experts.num_experts, expert_mlp, scale_inputs=experts.scale_inputs)
