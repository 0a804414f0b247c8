"""Mixture of experts, reference: route each token to its top-k experts, then run each expert on its tokens.

Weights as transformers stores them: ``gate_up`` [experts, 2 * inter, hidden] (the gate's rows, then
the up projection's) and ``down`` [experts, hidden, inter]. Routing follows Mixtral and Qwen3-MoE:
softmax over the router logits in float32, the top k, renormalized to sum to 1 when the model says so
(Mixtral always; Qwen3-MoE when ``norm_topk_prob``).
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


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """sum over k of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]: [T, hidden].

    One pass an expert that has tokens (a loop over experts, never over tokens), as transformers does."""
    def expert_mlp(expert: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(xs, gate_up[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[expert])

    return moe_by_expert(x, weights, ids, gate_up.shape[0], expert_mlp)


def moe_by_expert(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                  expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_mlp(ids[t, k], x_t): each expert that has tokens called once on
    all of them (``expert_mlp(e, x[tokens])`` -> [tokens, hidden]), the results summed in float32."""
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
        y = expert_mlp(expert, x[tokens])
        out.index_add_(0, tokens, y.float() * weights.flatten()[pairs, None])
    return out.to(x.dtype)
