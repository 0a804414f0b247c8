"""lmport loading GGUF files of every architecture it runs, against transformers loading the same file.

The files are the tiny random-weight models of tests/support/tiny_hf_models.py written as llama.cpp's
converter and llama-quantize write them (tests/support/gguf_files.py): Q4_K_M (Q4_K, Q6_K and, on
128-wide rows, the Q5_0 / Q8_0 fallbacks; norms and routers F32) for each architecture, and "EVERY"
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K in turn over the weights) for Llama (rows
of 256 and 512) and Mistral (rows of 128: the 256-weight types fall back).

- Greedy tokens: lmport (cpu, float32 compute, weights as the file holds them) against transformers'
  model of the same file (it dequantizes every tensor to float32 with gguf's reference dequantizer;
  for Mixtral, which transformers does not map, transformers' Mixtral holding those tensors, see
  support/greedy.py). 4 prompts (1 to 90 tokens) x 16 tokens, decoded together and each alone,
  identical required.
- Weight bytes: what lmport holds (``weight_bytes``) at most 1.1x the file's tensor bytes.
"""
from __future__ import annotations

import functools

import pytest

import lmport
from lmport import EngineConfig
from support import greedy
from support.gguf_files import tensor_bytes
from support.tiny_hf_models import ARCHS, gguf_file, tiny_config

NEW_TOKENS = 16
# In `make test`: every type (llama's EVERY file) and the Q4_K_M files of the three architectures whose conversion
# is undone most (Gemma 3's norms, Phi-3's fused projections, Qwen3-MoE's stacked quantized experts); mistral's
# EVERY file (the same types in a llama-shaped model) and the other Q4_K_M files run with the slow tests.
QUICK = {("llama", "EVERY"), ("gemma3", "Q4_K_M"), ("phi3", "Q4_K_M"), ("qwen3-moe", "Q4_K_M")}
CASES = [pytest.param(arch, preset, marks=() if (arch, preset) in QUICK else pytest.mark.slow)
         for arch, preset in [(arch, "Q4_K_M") for arch in ARCHS] + [("llama", "EVERY"), ("mistral", "EVERY")]]


@functools.cache
def pipeline(arch: str, preset: str):
    cfg = EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64)
    return lmport.pipeline(str(gguf_file(arch, preset)), backend_config=cfg)


def reference(arch: str, preset: str):
    return greedy.reference_model(str(gguf_file(arch, preset)), tiny_config(arch).model_type)


@pytest.mark.parametrize(("arch", "preset"), CASES)
def test_greedy_tokens_match_transformers_on_the_same_file(arch, preset):
    ids = greedy.prompts(4)
    want = greedy.hf_greedy(reference(arch, preset), ids, NEW_TOKENS)
    for alone in (False, True):
        got = greedy.lmport_greedy(pipeline(arch, preset), ids, NEW_TOKENS, alone=alone)
        same, diverged = greedy.agreement(got, want)
        assert same == len(ids), ("alone" if alone else "batched", diverged)


@pytest.mark.parametrize(("arch", "preset"), CASES)
def test_weights_held_within_1_1x_of_the_file(arch, preset):
    engine = pipeline(arch, preset).engine
    file_bytes = tensor_bytes(gguf_file(arch, preset))
    print(f"\n{arch} {preset}: lmport {engine.weight_bytes:,} B, file tensors {file_bytes:,} B "
          f"({engine.weight_bytes / file_bytes:.3f}x)")
    assert engine.weight_bytes <= 1.1 * file_bytes
