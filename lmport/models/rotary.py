"""The rotary module of a config: lmport's own for the models whose transformers rotary is Llama's, else
transformers' own.

Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE share one rotary class body in transformers
(``LlamaRotaryEmbedding``); building it meant importing the model's modeling module and, through it,
``transformers.modeling_utils`` (a second or more of a cold load). ``LlamaRotary`` computes the same cos and sin
with the same operations in the same order (its inverse frequencies from ``transformers.modeling_rope_utils``
for the scaled rope types). The types whose rows change with the sequence length ("dynamic", "longrope"), and
the other models (Gemma's per-layer-type bases, Phi-3's partial rotary), keep transformers' module.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lmport.models.rope_table import rows_depend_on_length

LLAMA_ROTARY_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3", "mixtral", "qwen2_moe",
                                      "qwen3_moe"})


class LlamaRotary(nn.Module):
    """transformers' ``LlamaRotaryEmbedding`` for a rope type whose rows do not depend on the length."""

    inv_freq: torch.Tensor

    def __init__(self, cfg):
        super().__init__()
        self.rope_type = cfg.rope_parameters["rope_type"]
        if self.rope_type == "default":
            base = cfg.rope_parameters["rope_theta"]
            dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            inv_freq, self.attention_scaling = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def transformers_rotary(cfg) -> nn.Module:
    """transformers' own rotary module for ``cfg``'s model type (imports its modeling module)."""
    from transformers import AutoModelForCausalLM

    from lmport.weights.gguf_config import as_transformers_config
    cfg = as_transformers_config(cfg)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    return type(skeleton.model.rotary_emb)(config=cfg)


def rotary_for(cfg) -> nn.Module:
    """The rotary module for ``cfg`` (its rope scaling, Gemma 3's per layer type)."""
    params = getattr(cfg, "rope_parameters", None)
    rope_type = params.get("rope_type") if isinstance(params, dict) else None
    if cfg.model_type in LLAMA_ROTARY_MODEL_TYPES and isinstance(rope_type, str) and \
            not rows_depend_on_length(SimpleNamespace(rope_type=rope_type)):
        return LlamaRotary(cfg)
    return transformers_rotary(cfg)
