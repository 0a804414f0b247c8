"""Llama 4 text GGUF files (llama.cpp's ``llama4``) made by llama.cpp's converter and llama-quantize
(tests/support/llama_cpp_families.py), loaded by lmport against transformers holding the same file's dequantized
tensors.

The tiny model (tests/support/tiny_float_models.py): 4 layers, layers 1 and 3 with 4 experts (top 1, the routing
weight scaling the expert's input) and a shared expert, layer 3 NoPE, L2 q/k norms on the rope layers. A llama4 file
does not store the chunk size nor the NoPE layers' temperature floor: llama.cpp takes the released models' (8192
both), and so do lmport and the reference (the tiny directory's 24 and 16 are not in the file). A second model has
Llama 4 Scout's llama3-type rope scaling, which the converter writes as ``rope_freqs.weight``.

Default run: the F32 files (exact weights) within float32's rounding of transformers' logits, and the Q8_0 file's
greedy tokens of 4 prompts. Slow: Q8_0 and Q4_K_M, 16 prompts x 32 tokens decoded together and each alone, at least
15 of 16 identical either way; the weight bytes lmport holds at most 1.1x the file's tensor bytes.
"""
from __future__ import annotations

import pytest
import torch

from support import greedy
from support.gguf_files import tensor_bytes
from support.llama_cpp_families import gguf_file, hf_prompt_logits, lmport_prompt_logits, reference_model


def _pipeline(path):
    import lmport
    from lmport import EngineConfig
    return lmport.pipeline(str(path), backend_config=EngineConfig(device_type="cpu", dtype="float32",
                                                                  cache_max_entry_count=256))


@pytest.mark.parametrize("arch", ["llama4", "llama4-rope-scaled"])
def test_an_f32_file_matches_transformers(arch):
    path = gguf_file(arch, "F32")
    ref = reference_model(arch, path)
    (ids,) = greedy.prompts(1, seed=5, lengths=(70,))   # past the scaled rope's 32 positions, in chunks of 16
    with _pipeline(path) as pipe:
        got = lmport_prompt_logits(pipe.engine, ids, 16)
    torch.testing.assert_close(got, hf_prompt_logits(ref, ids), atol=5e-5, rtol=1e-4)


def test_the_file_config_is_what_llama_cpp_assumes():
    from lmport.weights.gguf import transformers_config
    from support.llama_cpp_families import LLAMA4_FILE_FIELDS, tiny_config
    got, want = transformers_config(gguf_file("llama4", "Q8_0")), tiny_config("llama4")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok",
                  "moe_layers", "no_rope_layers", "use_qk_norm", "attn_scale", "attn_temperature_tuning",
                  "vocab_size"):
        assert getattr(got, field) == getattr(want, field), field
    assert {f: getattr(got, f) for f in LLAMA4_FILE_FIELDS} == LLAMA4_FILE_FIELDS


def test_a_q8_0_file_gives_transformers_tokens():
    path = gguf_file("llama4", "Q8_0")
    ids = greedy.prompts(4, lengths=(1, 7, 33, 60))
    want = greedy.hf_greedy(reference_model("llama4", path), ids, 12)
    with _pipeline(path) as pipe:
        assert greedy.lmport_greedy(pipe, ids, 12) == want
        assert pipe.engine.weight_bytes <= 1.1 * tensor_bytes(path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
def test_llama4_files_converted_by_llama_cpp(kind):
    path = gguf_file("llama4", kind)
    ids = greedy.prompts(16)
    want = greedy.hf_greedy(reference_model("llama4", path), ids, 32)
    with _pipeline(path) as pipe:
        greedy.check_file(pipe, path, ids, want, 32)


DAMAGED = [("llama4.block_count", 5, r"llama4\.block_count is 5, should be 4"),
           ("llama4.expert_count", 1000, r"llama4\.expert_count is 1000, should be 4"),
           ("llama4.expert_feed_forward_length", 64, r"llama4\.expert_feed_forward_length is 64, should be 32")]


@pytest.mark.parametrize(("key", "value", "message"), DAMAGED, ids=[f"{k}={v}" for k, v, _ in DAMAGED])
def test_a_damaged_header_is_refused_by_name(tmp_path, key, value, message):
    from lmport.errors import ConfigError
    from support.gguf_files import with_value
    path = with_value(gguf_file("llama4", "Q8_0"), key, value, tmp_path / "damaged.gguf")
    with pytest.raises(ConfigError, match=message):
        _pipeline(path)
