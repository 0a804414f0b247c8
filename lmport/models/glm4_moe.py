"""GLM-4.5 (transformers' ``glm4_moe``): the Llama-family decoder with mixture-of-experts MLPs.

What differs, each as transformers' Glm4Moe modules compute it:
- the first ``first_k_dense_replace`` layers keep a dense MLP; the others route each token to
  ``num_experts_per_tok`` of ``n_routed_experts`` experts and add ``n_shared_experts`` shared ones
  (one MLP of ``moe_intermediate_size * n_shared_experts``) that every token runs;
- the router scores experts by sigmoid, picks the best ``topk_group`` of ``n_group`` expert groups by
  the sum of each group's two best scores plus ``e_score_correction_bias``, then the top k inside them;
  the weights are the chosen experts' sigmoid scores (without the bias), renormalized when
  ``norm_topk_prob``, times ``routed_scaling_factor`` (lmport.ops.moe.route_grouped);
- rotary turns the first ``partial_rotary_factor`` of each head (lmport.models.layers.apply_rope);
  q and k are normalized per head when ``use_qk_norm``; q/k/v carry a bias when ``attention_bias``
  (o_proj never does).
The multi-token-prediction layer of the released checkpoints is not loaded (transformers drops it too).
Under tensor parallelism the routed and the shared experts are split by their intermediate dimension
(lmport.models.moe), the router replicated; one all-reduce sums both experts' partial outputs.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport.platform.backend import Backend
from lmport.models.layers import RowParallelLinear
from lmport.models.llama import MLP, PagedCausalLM
from lmport.models.moe import Experts, refuse_tp, shard_experts
from lmport.ops import route_grouped
from lmport.parallel import TPGroup

GLM4_MOE_MODEL_TYPES = ("glm4_moe",)


class GroupedRouter(nn.Module):
    """The router's weight (float32 in the checkpoint) and its score correction bias."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.empty(num_experts))


class SharedExpertMoeBlock(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.gate = GroupedRouter(cfg.n_routed_experts, cfg.hidden_size)
        self.experts: nn.Module = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, backend,
                                          tp)
        self.shared_experts = MLP(cfg, backend, tp, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.tp, self.backend = tp, backend
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.renormalize = bool(cfg.norm_topk_prob)
        self.scaling = float(cfg.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The router runs in float32 whatever the model's dtype, as transformers keeps it.
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        weights, ids = route_grouped(logits, self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                     self.topk_group, self.renormalize, self.scaling)
        routed, shared = self.experts.forward(x, weights, ids), self.shared_experts
        down = shared.down_proj
        if self.tp.size == 1 or type(down) is not RowParallelLinear:
            return self.tp.all_reduce(routed.contiguous()) + shared.forward(x)
        # Both partial sums in one all-reduce; down's bias (replicated) is added once, after it.
        y = self.tp.all_reduce((routed + self.backend.linear(shared.activated(x), down.weight, None)).contiguous())
        return y if down.bias is None else y + down.bias


class Glm4MoeCausalLM(PagedCausalLM):
    model_types = GLM4_MOE_MODEL_TYPES

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        refuse_tp(cfg, tp)
        if cfg.n_routed_experts % cfg.n_group:
            raise ValueError(f"{cfg.model_type}: n_routed_experts={cfg.n_routed_experts} is not a multiple of "
                             f"n_group={cfg.n_group}")
        super().__init__(cfg, backend, rotary, tp)
        for i, layer in enumerate(self.model.layers):
            if i >= cfg.first_k_dense_replace:
                layer.mlp = SharedExpertMoeBlock(cfg, backend, self.tp)

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_experts(self, super().shard_state_dict(full))

