"""A tiny random-weight Qwen3-Next (transformers' Qwen3NextConfig, float32) saved as a directory, and greedy
decoding through lmport's model over its paged cache and recurrent-state slots, driven step by step."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from support.model_helpers import saved_model


def tiny_config(num_layers: int = 4):
    """Linear, linear, linear, full (the released models' pattern), cycled; 4 experts (top 2) with a shared
    expert on every layer but layer 1, which keeps a dense MLP (``mlp_only_layers``)."""
    from transformers import Qwen3NextConfig
    types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(num_layers)]
    return Qwen3NextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1], layer_types=types,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _randomize(model) -> None:
    """Norms away from their constant starts, so that a model ignoring them (or their 1 + w form) would differ."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.5)


@functools.cache
def tiny_model_dir(num_layers: int = 4) -> str:
    from transformers import AutoModelForCausalLM

    def make():
        torch.manual_seed(61 + num_layers)
        model = AutoModelForCausalLM.from_config(tiny_config(num_layers), dtype=torch.float32).eval()
        _randomize(model)
        return model
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]
    return saved_model(f"qwen3-next-tiny-{num_layers}-{digest}", make)


def hf_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens (float32, its own cache), never stopping at an end-of-sequence token."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            got = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 min_new_tokens=new_tokens, pad_token_id=0)
            out.append(got[0, len(ids):].tolist())
    return out
