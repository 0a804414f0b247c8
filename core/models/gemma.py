"""Paged-attention decoder for Gemma 2 and Gemma 3 (text).

What differs from the Llama family (lmport.models.llama), each as transformers'
Gemma2/Gemma3 modules compute it:
- RMSNorm scales by (1 + weight), and each layer has four: before and after the
  attention, before and after the MLP;
- embeddings are multiplied by sqrt(hidden_size) (in the weights' dtype);
- attention scores use query_pre_attn_scalar ** -0.5, not head_dim ** -0.5, and
  (Gemma 2) are soft-capped: s -> cap * tanh(s / cap) (``attn_logit_softcapping``);
- sliding and global layers alternate (``config.layer_types``); Gemma 3 gives the
  two kinds their own rope bases (transformers' rotary module takes the layer type);
- Gemma 3 normalizes each head of q and k (with the (1 + weight) RMSNorm);
- the MLP is gelu-tanh gated; the final logits may be soft-capped too
  (``final_logit_softcapping``); the LM head is tied to the embeddings.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport.backend import Backend
from lmport.kv.layout import LayerCache
from lmport.models.llama import (MLP, Attention, ColumnParallelLinear, PagedCausalLM, RMSNorm,
                                 VocabParallelEmbedding)
from lmport.models.windows import layer_windows
from lmport.ops import AttentionMetadata
from lmport.parallel import TPGroup, split

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w scales by (1 + w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, 1.0 + self.weight, self.eps)


class GemmaAttention(Attention):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__(cfg, backend, tp)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.qk_norm = cfg.model_type == "gemma3_text"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, backend)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, backend)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        norm = [GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend) for _ in range(4)]
        self.input_layernorm, self.post_attention_layernorm = norm[0], norm[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm[2], norm[3]
        self.self_attn = GemmaAttention(cfg, backend, tp)
        self.mlp = MLP(cfg, backend, tp)

    def forward(self, x, cos, sin, cache: LayerCache, meta: AttentionMetadata):
        # Submodules through .forward, as in models/llama.py.
        h = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, cache, meta)
        x = x + self.post_attention_layernorm.forward(h)
        return x + self.post_feedforward_layernorm.forward(self.mlp.forward(self.pre_feedforward_layernorm.forward(x)))


class GemmaDecoder(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, backend, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)


class GemmaCausalLM(PagedCausalLM):
    model_types = GEMMA_MODEL_TYPES

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        nn.Module.__init__(self)
        if cfg.model_type not in self.model_types:
            raise ValueError(f"GemmaCausalLM runs {', '.join(self.model_types)}, not {cfg.model_type!r}")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not a causal LM; "
                             "lmport runs the causal Gemma 2 / Gemma 3 text models")
        self.config = cfg
        self.tp = tp = tp or TPGroup()
        self.model = GemmaDecoder(cfg, backend, tp)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, split(cfg.vocab_size, tp.size, tp.rank), False, backend)
        self.rotary = rotary
        self.windows = layer_windows(cfg)
        self.layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        # Gemma 3's rotary module takes the layer type (each has its own rope base); Gemma 2's does not.
        self.rope_per_layer_type = cfg.model_type == "gemma3_text"
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list[LayerCache]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        positions = meta.positions[None]
        ropes = {}
        for kind in set(self.layer_types):
            cos, sin = self.rotary(x, positions, kind) if self.rope_per_layer_type else self.rotary(x, positions)
            ropes[kind] = cos[0], sin[0]
        metas = {w: meta.for_layer(w, self.attn_softcap) for w in set(self.windows)}
        for layer, cache, window, kind in zip(self.model.layers, caches, self.windows, self.layer_types, strict=True):
            x = layer.forward(x, *ropes[kind], cache, metas[window])
        return self.model.norm.forward(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().logits(hidden)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
