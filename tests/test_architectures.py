"""Gemma 2, Gemma 3 (text), Phi-3, Mixtral and Qwen3-MoE against transformers: greedy tokens identical (float32) on five
prompts of 1 to 200 tokens with block sizes 16 and 64, and the logits of a prompt prefilled in three
chunks within 2e-4 (absolute; 1e-4 relative) of transformers' forward, as for the Llama family
(tests/test_engine_parity.py).

The tiny models (tests/models.py) have a 32-token window on their sliding layers, so the 200-token
prompts cross it; Gemma 2's are soft-capped (attention and final logits). The other backends run the
same models in tests/conformance/test_engine_backends.py.
"""
from __future__ import annotations

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from support.model_helpers import hf_greedy, hf_model, logits_in_chunks, tiny_model_dir

ARCHS = ("gemma2", "gemma3", "phi3", "mixtral", "qwen3-moe")
NEW_TOKENS = 8


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 5, 33, 64, 200)]


def greedy(model_dir: str, block_size: int) -> list[list[int]]:
    cfg = EngineConfig(device_type="cpu", dtype="float32", block_size=block_size,
                       cache_max_entry_count=2048 // block_size, max_prefill_token_num=128)
    with lmport.pipeline(model_dir, backend_config=cfg) as pipe:
        out = pipe.generate(prompts(), GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert pipe.engine.usage()["blocks_used"] == 0
    return [r.token_ids for r in out]


@pytest.mark.parametrize("block_size", [16, pytest.param(64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, block_size):
    model_dir = tiny_model_dir(arch)
    want = hf_greedy(model_dir, prompts(), NEW_TOKENS)
    assert greedy(model_dir, block_size) == want


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_in_three_chunks(arch):
    model_dir = tiny_model_dir(arch)
    ids = prompts()[-2]     # 64 tokens: chunks of 24, 24 and 16, past the 32-token window
    with lmport.pipeline(model_dir, backend_config=EngineConfig(device_type="cpu", dtype="float32",
                                                                cache_max_entry_count=64)) as pipe:
        engine = pipe.engine
        with torch.inference_mode():
            ref = hf_model(model_dir)(torch.tensor([ids])).logits[0]
        _, logits = logits_in_chunks(engine, ids, 24)
        assert len(logits) == 3
        torch.testing.assert_close(torch.cat(logits), ref, atol=2e-4, rtol=1e-4)


def test_unsupported_architecture_names_the_supported_ones():
    import transformers

    from lmport.models.architectures import model_class
    with pytest.raises(ValueError, match="not supported; supported: llama, mistral, qwen2, qwen3, gemma2"):
        model_class(transformers.GPT2Config())
