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
"""
from __future__ import annotations

import torch
from torch import nn

from lmport import ops
from lmport.platform.backend import Backend
from lmport.kv.layout import LayerCache
from lmport.models.layers import RMSNorm, apply_rope
from lmport.models.llama import Attention, PagedCausalLM
from lmport.models.moe import refuse_tp
from lmport.parallel import TPGroup

GPT_OSS_MODEL_TYPES = ("gpt_oss",)


class SinkAttention(Attention):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__(cfg, backend, tp)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, x, cos, sin, cache: LayerCache, meta: ops.AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is None:
            q, k, v = (p.forward(x).unflatten(-1, (-1, self.head_dim)) for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = self.qkv_proj.forward(x).unflatten(-1, (-1, self.head_dim)).split(self.qkv_heads, dim=1)
        q, k = apply_rope(self.backend, q, k, cos, sin)
        self.backend.fill_kv_cache(k, v, cache, meta.slot_mapping)
        layer_meta = meta.for_layer(meta.window, meta.softcap, self.sinks, meta.chunk)
        out = self.backend.paged_attention(q, cache, layer_meta, self.scale)
        return self.o_proj.forward(out.reshape(t, self.num_heads * self.head_dim))


class BiasedRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))


class BiasedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))


class ClampedSwigluMoe(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.router = BiasedRouter(cfg.num_local_experts, cfg.hidden_size)
        self.experts = BiasedExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size)
        self.top_k, self.alpha, self.limit = cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.route_top_k_softmax(self.backend.linear(x, self.router.weight, self.router.bias),
                                               self.top_k)
        e = self.experts
        return ops.clamped_swiglu_moe(x, e.gate_up_proj, e.gate_up_proj_bias, e.down_proj, e.down_proj_bias,
                                      weights, ids, self.alpha, self.limit)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = SinkAttention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = ClampedSwigluMoe(cfg, backend)

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

    def rope_rows(self, kind, x, meta):
        cos, sin = super().rope_rows(kind, x, meta)   # transformers' rows: half a head
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
