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

from torch import nn

from lmport.platform.backend import Backend
from lmport.kv.layout import LayerCache
from lmport.models.layers import RMSNorm
from lmport.models.llama import MLP, Attention, PagedCausalLM, layer_spec
from lmport.ops import AttentionMetadata, DecoderLayerSpec
from lmport.parallel import TPGroup

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
NORM_OFFSET = 1.0   # Gemma's RMSNorm scales by (1 + weight)


class GemmaAttention(Attention):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__(cfg, backend, tp)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.qk_norm = cfg.model_type == "gemma3_text"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend, NORM_OFFSET)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend, NORM_OFFSET)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        norm = [RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, NORM_OFFSET) for _ in range(4)]
        self.input_layernorm, self.post_attention_layernorm = norm[0], norm[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm[2], norm[3]
        self.self_attn = GemmaAttention(cfg, backend, tp)
        self.mlp = MLP(cfg, backend, tp)

    def forward(self, x, cos, sin, cache: LayerCache, meta: AttentionMetadata):
        # Submodules through .forward, as in models/llama.py.
        h = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, cache, meta)
        x = x + self.post_attention_layernorm.forward(h)
        return x + self.post_feedforward_layernorm.forward(self.mlp.forward(self.pre_feedforward_layernorm.forward(x)))

    def spec(self) -> DecoderLayerSpec | None:
        """This layer as data for a backend's decoder runner (lmport.ops.decoder), or None (layer_spec)."""
        return layer_spec(self.input_layernorm, self.self_attn, self.pre_feedforward_layernorm, self.mlp,
                          self.post_attention_layernorm, self.post_feedforward_layernorm)


class GemmaCausalLM(PagedCausalLM):
    """Gemma's differences as PagedCausalLM's hooks; the soft caps are read from the config there."""

    model_types = GEMMA_MODEL_TYPES
    layer_class = GemmaDecoderLayer
    norm_offset = NORM_OFFSET

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not a causal LM; "
                             "lmport runs the causal Gemma 2 / Gemma 3 text models")
        super().__init__(cfg, backend, rotary, tp)

    def embedding_scale(self, cfg) -> float:
        return cfg.hidden_size ** 0.5

    def layer_rope_kinds(self, cfg) -> list[str | None]:
        # Gemma 3's rotary module takes the layer type (each has its own rope base); Gemma 2's does not.
        if cfg.model_type != "gemma3_text":
            return super().layer_rope_kinds(cfg)
        return list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
