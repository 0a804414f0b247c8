"""lmport's rotary module (lmport.models.rotary) against transformers' own for the same config: cos and sin
bit for bit, for every model type that takes it and every rope type it runs; the rest get transformers'."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from lmport.models.rotary import LLAMA_ROTARY_MODEL_TYPES, LlamaRotary, rotary_for, transformers_rotary

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


def config(model_type: str, scaling: dict | None, **extra):
    return AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                max_position_embeddings=1024, rope_theta=5000.0, rope_scaling=scaling, **extra)


@pytest.mark.parametrize("model_type", sorted(LLAMA_ROTARY_MODEL_TYPES))
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_same_cos_sin_as_transformers(model_type, kind):
    cfg = config(model_type, SCALINGS[kind], head_dim=48 if model_type == "qwen3" else 32)
    ours, theirs = rotary_for(cfg), transformers_rotary(cfg)
    assert isinstance(ours, LlamaRotary) and ours.rope_type == theirs.rope_type
    positions = torch.tensor([[0, 1, 7, 255, 256, 1000, 3000]])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dtype)
        for got, want in zip(ours(x, positions), theirs(x, positions), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("model_type, scaling", [("llama", {"rope_type": "dynamic", "factor": 2.0}),
                                                 ("gemma3_text", None), ("phi3", None)])
def test_other_rotaries_are_transformers_own(model_type, scaling):
    cfg = config(model_type, scaling)
    assert type(rotary_for(cfg)) is type(transformers_rotary(cfg))
