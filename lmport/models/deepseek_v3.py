"""DeepSeek-V3 (transformers' ``deepseek_v3``): multi-head latent attention over a paged latent cache, and
mixture-of-experts MLPs with shared experts and group-limited routing.

What differs from the Llama family, each as transformers' DeepseekV3 modules compute it:
- attention is MLA (lmport.ops.mla): q comes from ``q_proj``, or through a low rank (``q_a_proj``, an RMSNorm,
  ``q_b_proj``) when ``q_lora_rank`` is set; each head's q splits into ``qk_nope_head_dim`` values without rotary
  and ``qk_rope_head_dim`` turned by rotary. ``kv_a_proj_with_mqa`` gives the compressed KV (``kv_lora_rank``,
  then an RMSNorm) and one rotary key shared by the heads; those two, side by side, are what a layer caches
  (the "latent" cache kind: 576 values a token for DeepSeek-V3). ``kv_b_proj``, which expands them into keys and
  values, is held as its two per-head halves and absorbed (``k_b_proj`` before attention, ``v_b_proj`` after,
  as llama.cpp's converter splits it). A backend runs it as the "latent" attention variant, or the model is
  refused before loading;
- the two low-rank RMSNorms take transformers' default epsilon (1e-6), not ``rms_norm_eps``;
- the softmax scale is 1 / sqrt(nope + rope) times yarn's mscale(factor, mscale_all_dim) squared when the rope
  is scaled; with ``rope_interleave`` transformers rotates interleaved pairs (2i, 2i + 1) of the rotary part and
  returns it as halves (evens, then odds): the rotary rows of the q and kv_a projections are reordered at load to
  halves, so that "rotate half" gives the same values;
- the first ``first_k_dense_replace`` layers keep a dense MLP; the others are GLM-4.5's shared-expert block
  (sigmoid scores, ``e_score_correction_bias``, the best ``topk_group`` of ``n_group`` groups, top k, renormalized
  when ``norm_topk_prob``, times ``routed_scaling_factor``: lmport.models.glm4_moe.SharedExpertMoeBlock).
The multi-token-prediction layer of the released checkpoints is not loaded (transformers drops it too).

Under tensor parallelism each rank holds its attention heads (q / q_b, k_b and v_b by output, o by input, one
all-reduce) and the whole latent path (q_a, kv_a and their norms, and the latent cache: every head reads it), and
a slice of every routed and shared expert's intermediate dimension (lmport.models.moe).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from lmport import ops
from lmport.kv.layout import CacheKind, LayerCache
from lmport.models.glm4_moe import Glm4MoeCausalLM
from lmport.models.layers import ColumnParallelLinear, HeadParallelLinear, Linear, RMSNorm, RowParallelLinear
from lmport.models.llama import MLP
from lmport.parallel import TPGroup
from lmport.platform.backend import Backend

DEEPSEEK_V3_MODEL_TYPES = ("deepseek_v3",)
LOW_RANK_NORM_EPS = 1e-6   # transformers' DeepseekV3RMSNorm default, which the q_a and kv_a norms keep


def latent_width(cfg) -> int:
    """Values a layer caches a token: the compressed KV and the shared rotary key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def softmax_scale(cfg) -> float:
    """1 / sqrt(q/k head dim), times mscale(factor, mscale_all_dim)^2 under a scaled (yarn) rope, as transformers'
    ``yarn_apply_mscale``."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        factor = params.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


class MlaAttention(nn.Module):
    """This rank's attention heads (all of them at tp=1) over the latent every head reads."""

    def __init__(self, cfg, backend: Backend, tp: TPGroup | None = None):
        super().__init__()
        self.backend = backend
        tp = tp or TPGroup()
        h0, h1 = tp.head_range(cfg.num_attention_heads)
        self.num_heads = h1 - h0
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk_dim, hidden, bias = self.nope_dim + self.rope_dim, cfg.hidden_size, bool(cfg.attention_bias)
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, (h0 * qk_dim, h1 * qk_dim), False, backend)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, backend)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LOW_RANK_NORM_EPS, backend)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, (h0 * qk_dim, h1 * qk_dim), False, backend)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_rank + self.rope_dim, bias, backend)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LOW_RANK_NORM_EPS, backend)
        # transformers' kv_b_proj as its two per-head halves, absorbed (lmport.ops.mla): each head's W_k
        # transposed [rank, nope], and W_v [v, rank]
        self.k_b_proj = HeadParallelLinear(self.nope_dim, self.kv_rank, (h0, h1), backend)
        self.v_b_proj = HeadParallelLinear(self.kv_rank, self.v_dim, (h0, h1), backend)
        self.o_proj = RowParallelLinear((h0 * self.v_dim, h1 * self.v_dim), hidden, bias, backend, tp)
        self.scale = softmax_scale(cfg)

    def forward(self, x, cos, sin, cache: LayerCache, meta: ops.AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj.forward(x)
        else:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x)))
        q_nope, q_rope = q.unflatten(-1, (self.num_heads, -1)).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa.forward(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm.forward(c_kv.contiguous())
        q_rope, k_rope = self.backend.apply_rotary(q_rope.contiguous(), k_rope[:, None].contiguous(), cos, sin)
        latent = torch.cat([c_kv, k_rope[:, 0]], dim=-1)
        self.backend.fill_latent_cache(latent, cache, meta.slot_mapping)
        q_lat = self.k_b_proj.forward(q_nope.contiguous())
        o_lat = self.backend.latent_attention(q_lat, q_rope, cache, meta, self.scale, latent)
        out = self.v_b_proj.forward(o_lat)
        return self.o_proj.forward(out.reshape(t, self.num_heads * self.v_dim))


class DeepseekV3DecoderLayer(nn.Module):
    """A dense layer as built; the model swaps in the shared-expert MoE block past ``first_k_dense_replace``."""

    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = MlaAttention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp: nn.Module = MLP(cfg, backend, tp)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


def interleaved_to_halves(rows: torch.Tensor) -> torch.Tensor:
    """A rotary part's rows (of a weight or bias) reordered from interleaved pairs (0, 1, 2, 3, ...) to halves
    (0, 2, 4, ..., 1, 3, 5, ...)."""
    return rows.unflatten(0, (-1, 2)).transpose(0, 1).flatten(0, 1)


class DeepseekV3CausalLM(Glm4MoeCausalLM):
    """GLM-4.5's mixture of experts (dense first layers, then shared and routed experts) under latent attention."""
    model_types = DEEPSEEK_V3_MODEL_TYPES
    layer_class = DeepseekV3DecoderLayer

    @classmethod
    def attention_variants(cls, cfg) -> set[str]:
        return {"latent"}

    @classmethod
    def cache_kinds(cls, cfg, tp_size: int = 1) -> tuple[CacheKind, ...]:
        return (CacheKind("latent", 1, latent_width(cfg)),) * cfg.num_hidden_layers

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cfg = self.config
        nope, rope, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        qk = nope + rope
        turned = dict(full)
        for name, t in full.items():
            if name.endswith("self_attn.kv_b_proj.weight"):   # [heads x (nope + v), rank]: its absorbed halves
                prefix, heads = name.removesuffix("kv_b_proj.weight"), t.unflatten(0, (cfg.num_attention_heads, -1))
                turned[f"{prefix}k_b_proj.weight"] = heads[:, :nope].transpose(1, 2).flatten(0, 1)
                turned[f"{prefix}v_b_proj.weight"] = heads[:, nope:].flatten(0, 1)
                del turned[name]
            elif not getattr(cfg, "rope_interleave", False):
                continue
            elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
                heads = t.unflatten(0, (-1, qk))   # [heads, nope + rope, in]: each head's rotary rows reordered
                rope_rows = heads[:, nope:].unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2)
                turned[name] = torch.cat([heads[:, :nope], rope_rows], dim=1).flatten(0, 1)
            elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
                turned[name] = torch.cat([t[:rank], interleaved_to_halves(t[rank:rank + rope])])
        return super().shard_state_dict(turned)
