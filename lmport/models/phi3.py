"""Phi-3: the Llama-family decoder with fused projections in the checkpoint.

Phi-3 checkpoints hold ``self_attn.qkv_proj`` (rows: q heads, then k heads, then v
heads) and ``mlp.gate_up_proj`` (rows: gate, then up). They are split at load into
the q/k/v and gate/up projections lmport.models.llama runs (views of the
checkpoint's tensors, no copy at tp=1), so tensor parallelism shards them as for
Llama. Rope scaling (su / longrope, and a partial rotary factor) is transformers'
own rotary module's; a sliding window, where the config sets one, is every layer's.
"""
from __future__ import annotations

import torch

from lmport.models.dims import head_dim_of
from lmport.models.llama import PagedCausalLM

PHI3_MODEL_TYPES = ("phi3",)


def split_fused(full: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A Phi-3 state dict with each fused projection split into the Llama names."""
    d = head_dim_of(cfg)
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out = {}
    for name, t in full.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name[:-len("qkv_proj.weight")]
            q, k, v = t.split([q_rows, kv_rows, kv_rows], dim=0)
            out |= {prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v}
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name[:-len("gate_up_proj.weight")]
            gate, up = t.chunk(2, dim=0)
            out |= {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up}
        else:
            out[name] = t
    return out


class Phi3CausalLM(PagedCausalLM):
    model_types = PHI3_MODEL_TYPES

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().shard_state_dict(split_fused(full, self.config))
