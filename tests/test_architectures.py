"""Gemma 2, Gemma 3 (text), Phi-3, Mixtral and Qwen3-MoE against transformers: greedy tokens identical (float32) on five
prompts of 1 to 200 tokens with block sizes 16 and 64, and the logits of a prompt prefilled in three
chunks within 2e-4 (absolute; 1e-4 relative) of transformers' forward, as for the Llama family
(tests/test_engine_parity.py).

The newer families (SmolLM3, GLM-4.5, gpt-oss, Llama 4 text; tests/support/tiny_float_models.py) against
transformers' generate: the five prompts batched, 24 new tokens each, prefilled in chunks of 40 tokens (across
block boundaries), with block sizes 16 and 64; after preemptions; and with prefix caching, a repeated prompt
giving the same tokens from cached blocks. A GGUF of an architecture lmport does not run (Qwen3-VL-MoE, GLM-4) is
refused by its name; the newer families' GGUF files load and are tested in tests/test_gguf_new_families.py
(SmolLM3, GLM-4.5), tests/test_gguf_gpt_oss.py, tests/test_gguf_llama4.py and, under these conditions,
tests/test_gguf_family_conditions.py.

The tiny models (tests/support/model_helpers.py) have a 32-token window on their sliding layers, so the 200-token
prompts cross it; Gemma 2's are soft-capped (attention and final logits). The other backends run the
same models in tests/conformance/test_engine_backends.py.
"""
from __future__ import annotations

import functools

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from support import tiny_float_models
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
    with pytest.raises(ValueError, match="not supported; supported: llama, mistral, qwen2, qwen3, smollm3, gemma2, "
                                         "gemma3_text, phi3, mixtral, qwen3_moe, glm4_moe, gpt_oss, llama4_text, "
                                         "deepseek_v3, qwen3_next, qwen3_5_text, qwen3_5_moe_text, qwen2_5_vl, "
                                         "qwen3_vl, idefics3, mistral3, gemma3, llama4$"):
        model_class(transformers.GPT2Config())


# -- the newer families ---------------------------------------------------------------------------------------

FAMILY_NEW_TOKENS = 24
CHUNK = 40   # prefill tokens a step: chunks end inside blocks of 16 and of 64


@functools.cache
def family_reference(arch: str) -> tuple[list[int], ...]:
    return tuple(hf_greedy(tiny_float_models.tiny_model_dir(arch), prompts(), FAMILY_NEW_TOKENS))


def family_run(arch: str, prompt_ids: list[list[int]], **config) -> tuple[list[list[int]], dict]:
    """Greedy tokens of the prompts, submitted together (one batch), and the engine's usage once they finished."""
    config = dict(device_type="cpu", dtype="float32", max_prefill_token_num=CHUNK) | config
    with lmport.pipeline(tiny_float_models.tiny_model_dir(arch), backend_config=EngineConfig(**config)) as pipe:
        out = pipe.generate(prompt_ids, GenerationConfig(max_new_tokens=FAMILY_NEW_TOKENS, ignore_eos=True))
        usage = pipe.engine.usage()
    assert usage["blocks_used"] == 0, "every block must be free once all requests finished"
    return [r.token_ids for r in out], usage


@pytest.mark.parametrize("arch", tiny_float_models.ARCHS)
def test_family_matches_transformers_chunked_preempted_and_prefix_cached(arch):
    """One run: the prompts in 40-token chunks, the 200-token one again at the end (its full blocks found in
    the prefix cache), in 24 blocks of 16 tokens, fewer than the six sequences need (the scheduler preempts)."""
    ps, want = prompts(), list(family_reference(arch))
    tokens, usage = family_run(arch, [*ps, ps[-1]], block_size=16, cache_max_entry_count=24,
                               enable_prefix_caching=True)
    assert usage["preemptions"] > 0
    assert usage["prefix_cache_hit_blocks_device"] > 0
    assert tokens == [*want, want[-1]]


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("arch", tiny_float_models.ARCHS)
def test_family_greedy_matches_transformers_in_chunks(arch, block_size):
    tokens, usage = family_run(arch, prompts(), block_size=block_size, cache_max_entry_count=4096 // block_size)
    assert usage["preemptions"] == 0
    assert tokens == list(family_reference(arch))


@pytest.mark.slow
@pytest.mark.parametrize("block_size,blocks", [(16, 20), (64, 6)])
@pytest.mark.parametrize("arch", tiny_float_models.ARCHS)
def test_family_greedy_matches_transformers_after_preemption(arch, block_size, blocks):
    # Too few blocks for the five sequences (about 420 tokens): the scheduler preempts.
    tokens, usage = family_run(arch, prompts(), block_size=block_size, cache_max_entry_count=blocks)
    assert usage["preemptions"] > 0
    assert tokens == list(family_reference(arch))


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("arch", tiny_float_models.ARCHS)
def test_family_prefix_cache_repeats_the_tokens(arch, block_size):
    """The 200-token prompt again once the others finished: its full blocks come from the prefix cache."""
    ps, want = prompts(), list(family_reference(arch))
    config = EngineConfig(device_type="cpu", dtype="float32", max_prefill_token_num=CHUNK, block_size=block_size,
                          cache_max_entry_count=4096 // block_size, enable_prefix_caching=True)
    gen = GenerationConfig(max_new_tokens=FAMILY_NEW_TOKENS, ignore_eos=True)
    with lmport.pipeline(tiny_float_models.tiny_model_dir(arch), backend_config=config) as pipe:
        first = [r.token_ids for r in pipe.generate(ps, gen)]
        again = pipe.generate([ps[-1]], gen)[0].token_ids
        usage = pipe.engine.usage()
    assert usage["prefix_cache_hit_blocks_device"] == 200 // block_size
    assert [*first, again] == [*want, want[-1]]


def test_a_backend_without_sinks_refuses_gpt_oss_before_loading(monkeypatch):
    from lmport.errors import ConfigError
    # Nothing may be read from the checkpoint's tensors before the refusal.
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded before the capability check"))
    with pytest.raises(ConfigError, match="'gpt_oss' needs attention sinks, which device 'example' does not run"):
        lmport.pipeline(tiny_float_models.tiny_model_dir("gpt-oss"), backend_config=EngineConfig(device_type="example"))


@pytest.mark.parametrize("architecture", ["qwen3vlmoe", "glm4"])
def test_gguf_of_a_newer_family_is_refused_by_name(tmp_path, architecture):
    """A GGUF of a family lmport does not load from GGUF (Qwen3-VL-MoE, GLM-4): refused by its architecture, before any
    tensor is read."""
    import gguf

    from lmport.errors import ConfigError
    path = tmp_path / f"tiny-{architecture}.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=f"GGUF architecture '{architecture}' is not supported"):
        lmport.pipeline(str(path), backend_config=EngineConfig(device_type="cpu"))
