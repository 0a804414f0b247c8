"""Paged-attention decoder for the Llama family (Llama, SmolLM2, Mistral), Qwen2 and Qwen3.

Parameter names match transformers' so its state dict loads as is. Every
device-specific op (linear, RMSNorm, rotary, the gated activation, KV fill,
paged attention) goes through the backend; the rest is plain torch.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from lmport.backend import Backend
from lmport.kv.layout import LayerCache
from lmport.ops import AttentionMetadata

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: Backend):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear whose matmul the backend runs (a BLAS may want another operand order)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: Backend):
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.backend = backend
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.scale = self.head_dim ** -0.5
        qkv_bias = cfg.model_type == "qwen2" or getattr(cfg, "attention_bias", False)
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, qkv_bias, backend)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, qkv_bias, backend)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, qkv_bias, backend)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size,
                             getattr(cfg, "attention_bias", False) and cfg.model_type != "qwen2", backend)
        # Qwen3 normalizes each head of q and k before rotary.
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend)

    def forward(self, x, cos, sin, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        # unflatten, not view: a backend's linear need not return a contiguous result.
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.backend.apply_rotary(q, k, cos, sin)
        self.backend.fill_kv_cache(k, v, cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias, backend)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias, backend)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias, backend)
        self.backend = backend
        self.act = None if cfg.hidden_act == "silu" else ACT2FN[cfg.hidden_act]

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act is None:
            return self.down_proj(self.backend.silu_and_mul(gate, up))
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = MLP(cfg, backend)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)


class PagedCausalLM(nn.Module):
    """``forward`` runs one step's new tokens (flattened over sequences) and returns hidden states."""

    def __init__(self, cfg, backend: Backend, rotary: nn.Module):
        super().__init__()
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {cfg.model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        self.config = cfg
        self.model = Decoder(cfg, backend)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, backend)
        self.rotary = rotary  # transformers' own rotary module: every rope variant it knows

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list[LayerCache]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(x, meta.positions[None])
        cos, sin = cos[0], sin[0]
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, meta)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float().contiguous()  # sampling wants rows; linear need not give them
