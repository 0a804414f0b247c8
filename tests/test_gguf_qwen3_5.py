"""Qwen3.5 GGUF files (llama.cpp's ``qwen35`` and ``qwen35moe``) made by llama.cpp's converter and llama-quantize
(tests/support/llama_cpp_families.py), loaded by lmport against transformers holding the same file's dequantized
tensors.

The tiny models: tests/support/qwen3_5_model.py's text configs (linear, linear, linear, full attention; 2 key heads
and 4 value heads in the linear layers, whose value heads the converter stores tiled over the key heads; a
multimodal rotary), dense and MoE (4 experts, top 2, a shared expert), converted with ``--no-mtp``.

Default run: the dense model's F32 file (exact weights: logits within float32's rounding of transformers' on the
source directory's own model), and its Q8_0 file (logits within 0.3% of their range: the cpu kernels' Q8_0
projections; greedy tokens of 4 prompts identical). Slow: dense and MoE, Q8_0 and Q4_K_M, 16 prompts x 32 tokens
decoded together and each alone, at least 15 of 16 identical either way; the weight bytes lmport holds at most 1.1x
the file's tensor bytes.
"""
from __future__ import annotations

import pytest
import torch

from support import greedy
from support.llama_cpp_families import (gguf_file, hf_prompt_logits, lmport_prompt_logits, reference_model,
                                        tiny_model_dir)


def _pipeline(path):
    import lmport
    from lmport import EngineConfig
    return lmport.pipeline(str(path), backend_config=EngineConfig(device_type="cpu", dtype="float32",
                                                                  cache_max_entry_count=256))


def test_an_f32_file_computes_as_its_source_directory():
    from transformers import AutoModelForCausalLM
    (ids,) = greedy.prompts(1, seed=5, lengths=(70,))
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3.5"), dtype=torch.float32).eval()
    with _pipeline(gguf_file("qwen3.5", "F32")) as pipe:
        assert pipe.engine.model.model.layers[0].linear_attn.tiled_v_heads
        got = lmport_prompt_logits(pipe.engine, ids, len(ids))
    torch.testing.assert_close(got, hf_prompt_logits(source, ids), atol=2e-5, rtol=1e-4)


def test_a_q8_0_file_matches_transformers_on_its_tensors():
    path = gguf_file("qwen3.5", "Q8_0")
    ref = reference_model("qwen3.5", path)
    (long_ids,) = greedy.prompts(1, seed=5, lengths=(70,))
    ids = greedy.prompts(4, lengths=(1, 7, 33, 60))
    want = greedy.hf_greedy(ref, ids, 12)
    with _pipeline(path) as pipe:
        got_logits = lmport_prompt_logits(pipe.engine, long_ids, len(long_ids))
    want_logits = hf_prompt_logits(ref, long_ids)
    torch.testing.assert_close(got_logits, want_logits, atol=3e-3 * float(want_logits.abs().max()), rtol=0)
    with _pipeline(path) as pipe:
        assert greedy.lmport_greedy(pipe, ids, 12) == want


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch", ["qwen3.5", "qwen3.5-moe"])
def test_qwen3_5_files_converted_by_llama_cpp(arch, kind):
    path = gguf_file(arch, kind)
    ids = greedy.prompts(16)
    want = greedy.hf_greedy(reference_model(arch, path), ids, 32)
    with _pipeline(path) as pipe:
        greedy.check_file(pipe, path, ids, want, 32)


DAMAGED = [("qwen35.block_count", 5, r"qwen35\.block_count is 5, should be 4"),
           ("qwen35.embedding_length", 128, r"qwen35\.embedding_length is 128, should be 64")]


@pytest.mark.parametrize(("key", "value", "message"), DAMAGED, ids=[f"{k}={v}" for k, v, _ in DAMAGED])
def test_a_damaged_header_is_refused_by_name(tmp_path, key, value, message):
    from lmport.errors import ConfigError
    from support.gguf_files import with_value
    path = with_value(gguf_file("qwen3.5", "Q8_0"), key, value, tmp_path / "damaged.gguf")
    with pytest.raises(ConfigError, match=message):
        _pipeline(path)
