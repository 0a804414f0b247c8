"""Mixture of experts, reference: route each token to its top-k experts, then run each expert on its tokens.

Weights as transformers stores them: ``gate_up`` [experts, 2 * inter, hidden] (the gate's rows, then
the up projection's) and ``down`` [experts, hidden, inter]. Routing follows Mixtral and Qwen3-MoE
(``route``): softmax over the router logits in float32, the top k, renormalized to sum to 1 when the
model says so (Mixtral always; Qwen3-MoE when ``norm_topk_prob``); GLM-4.5's group-limited sigmoid
routing is ``route_grouped``, gpt-oss's softmax over the top k logits ``route_top_k_softmax`` (its
experts, with biases and a clamped SwiGLU, ``clamped_swiglu_moe``), Llama 4's sigmoid of the top k
``route_top_k_sigmoid`` (its experts, the weight scaling their input, ``input_scaled_moe``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


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
        gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(min=-limit, max=limit)
        return ((up + 1) * (gate * torch.sigmoid(gate * alpha))) @ down[expert] + down_bias[expert]

    return moe_by_expert(x, weights, ids, gate_up.shape[0], expert_mlp)


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
