"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Both are the Llama-family decoder (lmport.models.llama; Qwen3-MoE with Qwen3's
per-head q/k norm) whose MLP is, on its sparse layers, a router and a set of
gated-MLP experts. Parameter names match transformers' (``mlp.gate.weight``
[experts, hidden]; ``mlp.experts.gate_up_proj`` [experts, 2 * inter, hidden],
``mlp.experts.down_proj`` [experts, hidden, inter]). Routing: softmax in float32,
top-k, renormalized always (Mixtral) or when ``norm_topk_prob`` (Qwen3-MoE); float
experts run through ``Backend.fused_moe``, quantized ones (a GGUF's, lmport.models.quantized.QuantExperts)
expert by expert through the backend's quantized linear. Qwen3-MoE's dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) keep the ordinary MLP. The experts are
not sharded: tensor parallelism is refused for these models.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport.platform.backend import Backend
from lmport.models.llama import PagedCausalLM
from lmport.ops import route
from lmport.parallel import TPGroup

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")


class Experts(nn.Module):
    """Float experts, run by ``Backend.fused_moe``; a loader replaces them by ``QuantExperts``
    (lmport.models.quantized) where the checkpoint's experts are quantized."""

    def __init__(self, num_experts: int, hidden: int, inter: int, backend: Backend):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.backend = backend

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        self.gate = Router(num_experts, cfg.hidden_size)
        self.experts: nn.Module = Experts(num_experts, cfg.hidden_size, inter, backend)
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.backend.linear(x, self.gate.weight)
        weights, ids = route(logits, self.top_k, self.renormalize)
        return self.experts.forward(x, weights, ids)


def is_sparse_layer(cfg, index: int) -> bool:
    """Whether layer ``index`` has experts (Qwen3-MoE's rule; every Mixtral layer does)."""
    if cfg.model_type == "mixtral":
        return True
    if index in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return cfg.num_experts > 0 and (index + 1) % step == 0


def refuse_tp(cfg, tp: TPGroup | None) -> None:
    """Mixture-of-experts models run at tp=1 only: their experts are not sharded."""
    if tp is not None and tp.size > 1:
        raise ValueError(f"{cfg.model_type}: tensor parallelism (tp={tp.size}) is not supported for "
                         f"mixture-of-experts models (the experts are not sharded); use tp=1")


class MoeCausalLM(PagedCausalLM):
    model_types = MOE_MODEL_TYPES

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        refuse_tp(cfg, tp)
        super().__init__(cfg, backend, rotary, tp)
        for i, layer in enumerate(self.model.layers):
            if is_sparse_layer(cfg, i):
                layer.mlp = SparseMoeBlock(cfg, backend)
