"""Qwen3.5's text model (transformers' ``qwen3_5_text`` and ``qwen3_5_moe_text``): Qwen3-Next's hybrid decoder
(lmport.models.qwen3_next) with three changes, each as transformers' Qwen3_5 modules compute it:
- a linear-attention layer projects q, k, v (``in_proj_qkv``, in the conv's channel order), the output gate z
  (``in_proj_z``) and b, a (``in_proj_b``, ``in_proj_a``) each on its own, instead of Qwen3-Next's two
  projections grouped by key head;
- the dense model (``qwen3_5_text``) has a gated MLP on every layer; the MoE model (``qwen3_5_moe_text``) has
  routed experts plus the shared expert on every layer, its router always renormalizing the top k (its config has
  no ``norm_topk_prob`` nor ``mlp_only_layers``);
- rotary is multimodal (mrope: t, h, w positions over sections of the frequencies); a text-only sequence has the
  same position on the three axes, which is ordinary (partial) rotary. transformers' rotary module computes it.

The released checkpoints are image-text models (``qwen3_5``, ``qwen3_5_moe``): lmport runs their text model
(``text_model_config`` takes the config's ``text_config``; transformers' causal LM reads the language model's
tensors from the same files). The vision tower is not loaded. Tensor parallelism is refused, as for Qwen3-Next.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport.errors import ConfigError
from lmport.models.layers import Linear
from lmport.models.llama import MLP
from lmport.models.qwen3_next import GatedDeltaNet, Qwen3NextCausalLM, Qwen3NextDecoderLayer, SharedExpertMoe
from lmport.parallel import TPGroup
from lmport.platform.backend import Backend

QWEN3_5_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
# The image-text configs whose text model lmport runs, and the text model's type in each.
QWEN3_5_WRAPPER_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_model_config(cfg):
    """A Qwen3.5 image-text config's text model's config (lmport.models.architectures.TEXT_VIEWS)."""
    return cfg.get_text_config()


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's linear-attention layer over four separate projections."""

    def make_projections(self, hidden: int, backend: Backend) -> None:
        self.in_proj_qkv = Linear(hidden, 2 * self.key_size + self.value_size, False, backend)
        self.in_proj_z = Linear(hidden, self.value_size, False, backend)
        self.in_proj_b = Linear(hidden, self.num_v_heads, False, backend)
        self.in_proj_a = Linear(hidden, self.num_v_heads, False, backend)

    def split_projections(self, x: torch.Tensor):
        z = self.in_proj_z.forward(x).unflatten(-1, (self.num_v_heads, self.v_dim))
        return self.in_proj_qkv.forward(x), z, self.in_proj_b.forward(x), self.in_proj_a.forward(x)


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    linear_attention = Qwen3_5GatedDeltaNet

    def make_mlp(self, cfg, backend: Backend, tp: TPGroup, index: int) -> nn.Module:
        if cfg.model_type == "qwen3_5_moe_text":
            return SharedExpertMoe(cfg, backend, tp, renormalize=True)
        return MLP(cfg, backend, tp)


class Qwen3_5CausalLM(Qwen3NextCausalLM):
    model_types = QWEN3_5_MODEL_TYPES
    decoder_layer = Qwen3_5DecoderLayer

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        if tp is not None and tp.size > 1:
            raise ConfigError(f"{cfg.model_type}: tensor parallelism (tp={tp.size}) cannot split this model: its "
                              f"linear-attention layers are not split over ranks; this model supports tp in [1]")
        super().__init__(cfg, backend, rotary, tp)
