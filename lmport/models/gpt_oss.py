"""gpt-oss (transformers' ``gpt_oss``): the Llama-family decoder with attention sinks and biased experts.

What differs, each as transformers' GptOss modules compute it:
- each attention head has a learned sink logit (``self_attn.sinks``) that joins the softmax's
  denominator and weighs no value: a backend runs it as the "sinks" attention variant
  (lmport.ops.AttentionMetadata.sinks), and a backend without it is refused before loading;
- sliding (``sliding_window``, 128 in the released models) and full attention layers alternate
  (``config.layer_types``); q, k, v and o carry biases;
- rotary is yarn-scaled; transformers' module gives cos and sin of half a head (its rotation pairs
  dimension i with i + head_dim / 2, as "rotate half" does), widened here to the whole head;
- every MLP is a mixture of experts: a router with a bias, the top k logits softmaxed, and experts with
  biases and a clamped SwiGLU (lmport.ops.moe.clamped_swiglu_moe), held in transformers' layout.
Under tensor parallelism each rank holds its heads (and their sinks) and a slice of every expert's intermediate
dimension (lmport.models.moe); the experts' down bias is held whole by rank 0 and as zeros by the others, so the
all-reduce adds it once.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport import ops
from lmport.platform.backend import Backend
from lmport.models.layers import RMSNorm
from lmport.models.llama import Attention, PagedCausalLM
from lmport.models.moe import expert_range, refuse_tp, shard_experts
from lmport.models.quantized import QuantExperts
from lmport.parallel import TPGroup

GPT_OSS_MODEL_TYPES = ("gpt_oss",)


class SinkAttention(Attention):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__(cfg, backend, tp)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def layer_meta(self, meta: ops.AttentionMetadata) -> ops.AttentionMetadata:
        return meta.for_layer(meta.window, meta.softcap, self.sinks, meta.chunk)


class BiasedRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))


class BiasedExperts(nn.Module):
    """This rank's slice [start, end) of every expert's intermediate dimension (all of it at tp=1)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp: TPGroup, backend: Backend):
        super().__init__()
        self.backend = backend
        self.shard_range, self.rank = expert_range(inter, tp), tp.rank
        part = self.shard_range[1] - self.shard_range[0]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * part))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * part))
        self.down_proj = nn.Parameter(torch.empty(num_experts, part, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))

    def shard_expert_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full checkpoint tensor ``name``: gate and up columns interleave (gate even,
        up odd), so intermediate columns [start, end) are gate_up's columns [2 start, 2 end); the down bias is
        added after the ranks' sum, so only rank 0 keeps it."""
        start, end = self.shard_range
        if name in ("gate_up_proj", "gate_up_proj_bias"):
            return full[..., 2 * start:2 * end].clone()
        if name == "down_proj":
            return full[:, start:end].clone()
        return full.clone() if self.rank == 0 else torch.zeros_like(full)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, alpha: float,
                limit: float) -> torch.Tensor:
        return self.backend.clamped_swiglu_moe(x, self.gate_up_proj, self.gate_up_proj_bias, self.down_proj,
                                               self.down_proj_bias, weights, ids, alpha, limit)

    def quantized_experts(self, gate, up, down, backend: Backend) -> nn.Module:
        """The twin of these experts over quantized gate, up and down weights as a GGUF stacks them."""
        num_experts, hidden, gate_up = self.gate_up_proj.shape
        return QuantBiasedExperts(gate, up, down, num_experts, hidden, gate_up // 2, backend)


class QuantBiasedExperts(QuantExperts):
    """gpt-oss's experts over quantized weights as llama.cpp's converter writes them: gate, up and down each one
    weight stacked over the experts (``ffn_{gate,up,down}_exps``: MXFP4 blocks in the released files), gate and up
    apart, each with its bias; run by ``Backend.quantized_moe`` with the clamped SwiGLU."""

    def __init__(self, gate, up, down, num_experts: int, hidden: int, inter: int, backend: Backend):
        for name, w, rows, inputs in (("gate_proj", gate, inter, hidden), ("up_proj", up, inter, hidden),
                                      ("down_proj", down, hidden, inter)):
            if (w.out_features, w.in_features) != (num_experts * rows, inputs):
                raise ValueError(f"experts.{name}: quantized experts are [{w.out_features}, {w.in_features}] but "
                                 f"the model config makes them {num_experts} x {[rows, inputs]}")
        super().__init__(gate, up, down, num_experts, backend)
        self.gate_proj_bias = nn.Parameter(torch.empty(num_experts, inter), requires_grad=False)
        self.up_proj_bias = nn.Parameter(torch.empty(num_experts, inter), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_proj_bias, self.up_proj_bias, self.down_proj_bias

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, alpha: float,  # type: ignore[override]
                limit: float) -> torch.Tensor:
        return self.backend.quantized_moe(x, self.described(clamp=(alpha, limit)), weights, ids)


class ClampedSwigluMoe(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.router = BiasedRouter(cfg.num_local_experts, cfg.hidden_size)
        self.experts = BiasedExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, tp, backend)
        self.top_k, self.alpha, self.limit = cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit
        self.backend, self.tp = backend, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.route_top_k_softmax(self.backend.linear(x, self.router.weight, self.router.bias),
                                               self.top_k)
        return self.tp.all_reduce(self.experts.forward(x, weights, ids, self.alpha, self.limit).contiguous())


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = SinkAttention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = ClampedSwigluMoe(cfg, backend, tp)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class GptOssCausalLM(PagedCausalLM):
    model_types = GPT_OSS_MODEL_TYPES
    layer_class = GptOssDecoderLayer

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        refuse_tp(cfg, tp)
        super().__init__(cfg, backend, rotary, tp)

    @classmethod
    def attention_variants(cls, cfg) -> set[str]:
        return {"sinks"}

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = shard_experts(self, super().shard_state_dict(full))
        if self.tp.size > 1:   # each head's sink goes with its head
            start, end = self.tp.head_range(self.config.num_attention_heads)
            for name in [n for n in out if n.endswith("self_attn.sinks")]:
                out[name] = out[name][start:end].clone()
        return out

    def rope_rows(self, kind, x, meta):
        cos, sin = super().rope_rows(kind, x, meta)   # transformers' rows: half a head
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
