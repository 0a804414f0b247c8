"""Tiny random-weight Qwen3.5 models (transformers' Qwen3_5 / Qwen3_5Moe config classes, float32) saved as
directories, and transformers' greedy tokens for them.

``dense``: the image-text model as Qwen3.5 is released (``qwen3_5``: a ``text_config`` and a one-block vision
tower, the language model's tensors under ``model.language_model``), its reference transformers'
Qwen3_5ForConditionalGeneration on text-only input. ``moe``: the text model alone (``qwen3_5_moe_text``), its
reference Qwen3_5MoeForCausalLM."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from support.model_helpers import saved_model
from support.qwen3_next_model import _randomize

KINDS = ("dense", "moe")


def text_config_fields(num_layers: int = 4) -> dict:
    """Linear, linear, linear, full, cycled (the released pattern); a rotary over a quarter of each head with
    mrope sections summing to its 4 frequencies."""
    types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(num_layers)]
    return dict(
        vocab_size=49152, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                      "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=types, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def tiny_config(kind: str):
    from transformers import Qwen3_5Config, Qwen3_5MoeTextConfig
    if kind == "dense":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        return Qwen3_5Config(text_config=text_config_fields() | dict(intermediate_size=96), vision_config=vision,
                             tie_word_embeddings=False)
    if kind == "moe":   # 4 experts, top 2, and the shared expert on every layer
        return Qwen3_5MoeTextConfig(**text_config_fields(), num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48)
    raise ValueError(kind)


def reference_class(kind: str):
    import transformers
    return transformers.Qwen3_5ForConditionalGeneration if kind == "dense" else transformers.Qwen3_5MoeForCausalLM


def tiny_model(kind: str):
    """A seeded random-weight model of ``tiny_config(kind)`` (float32, eval)."""
    torch.manual_seed(35)
    model = reference_class(kind)(tiny_config(kind)).to(torch.float32).eval()
    _randomize(model)
    return model


@functools.cache
def tiny_model_dir(kind: str) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]
    return saved_model(f"qwen3_5-tiny-{kind}-{digest}", lambda: tiny_model(kind))


def hf_greedy(kind: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens (float32, its own cache), never stopping at an end-of-sequence token."""
    model = reference_class(kind).from_pretrained(tiny_model_dir(kind), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            got = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 min_new_tokens=new_tokens, pad_token_id=0)
            out.append(got[0, len(ids):].tolist())
    return out
