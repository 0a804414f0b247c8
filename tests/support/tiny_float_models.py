"""Tiny random-weight models of the newer families (SmolLM3, GLM-4.5, gpt-oss, Llama 4 text), saved as transformers
directories. lmport loads these families from GGUF files too: the GGUF tests convert models of these configs with
llama.cpp's converter (tests/test_gguf_new_families.py: SmolLM3, GLM-4.5; tests/support/llama_cpp_families.py:
gpt-oss, Llama 4).

Built as tests/support/tiny_hf_models.py builds the older families' (seeded ``from_config``, float32, saved with
the default model's tokenizer), with the shapes of tests/support/model_helpers.py (hidden 64) and four layers, so
that each family's odd layer (NoPE, dense, full-attention) is there; the parameters transformers initializes to
constants (norms, routing biases, sinks) are made random so that a model ignoring them would differ.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from support.model_helpers import saved_model

VOCAB = 49152


def _version() -> str:
    """A digest of this file: cached models are rebuilt when the configs change."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]


# The newer families, float checkpoints only: each config sets what makes the family differ, small.
ARCHS = ("smollm3", "glm4-moe", "gpt-oss", "llama4")


def tiny_config(arch: str):
    """A tiny config of a newer family: 4 layers (a NoPE or dense layer among them), hidden 64, the default
    model's vocabulary."""
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  rms_norm_eps=1e-5, initializer_range=0.2)   # weights large enough for attention to be sharp
    if arch == "smollm3":      # layer 3 (every 4th) without rotary; q/k/v/o biases
        return transformers.SmolLM3Config(**common, intermediate_size=128, attention_bias=True,
                                          no_rope_layer_interval=4, pad_token_id=0)
    if arch == "glm4-moe":     # layer 0 dense; 8 experts in 4 groups, the best 2 groups, top 3; a shared expert;
        # half the head turned by rotary; q/k norms; a score correction bias and a routed scale
        return transformers.Glm4MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                          n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                          n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                          norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5})
    if arch == "gpt-oss":      # sliding (24 tokens) and full layers alternating; sinks; 4 experts, top 2; yarn rope
        return transformers.GptOssConfig(**common, intermediate_size=32, head_dim=16, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=24, attention_bias=True,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                          "original_max_position_embeddings": 64})
    if arch == "llama4":       # chunks of 24 on rope layers, layer 3 NoPE with temperature tuning (floor 16);
        # layers 1 and 3 with 4 experts, top 1, and a shared expert; L2 q/k norms
        return transformers.Llama4TextConfig(**common, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
                                             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                             attention_chunk_size=24, floor_scale=16, attn_scale=0.1,
                                             use_qk_norm=True, pad_token_id=0)
    raise ValueError(arch)


def randomize_constants(model, biases: tuple[str, ...] = ("e_score_correction_bias", "sinks", "router.bias")) -> None:
    """Parameters transformers initializes to constants (norms to 1, the ``biases``: routing biases and sinks, to 0)
    made random, so that a model that ignored them would differ."""
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(biases):
                p.copy_(torch.randn_like(p) * 0.5)


def tiny_model(arch: str):
    """A random-weight model of ``tiny_config(arch)`` (seeded, float32, eval)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(2026 + ARCHS.index(arch))
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    randomize_constants(model)
    return model


@functools.cache
def tiny_model_dir(arch: str) -> str:
    """``tiny_model(arch)`` saved as a transformers directory with the default model's tokenizer."""
    return saved_model(f"float-tiny-{arch}-{_version()}", lambda: tiny_model(arch))


