"""Qwen3.5's text model (lmport.models.qwen3_5) against transformers (float32, greedy) on tiny random-weight
models saved as directories: the dense model as released (an image-text directory, compared with transformers'
Qwen3_5ForConditionalGeneration on text-only input) and the MoE text model (Qwen3_5MoeForCausalLM). The model
driven step by step over its paged cache and state slots, and the engine (chunked prefill across block
boundaries, a batch of requests, preemption by recompute). Also: the image-text config is planned and checked
as its text model, and tensor parallelism is refused before any weight loads."""
from __future__ import annotations

import functools

import pytest
import torch

import lmport
from lmport.config import EngineConfig, GenerationConfig
from lmport.errors import ConfigError
from support.qwen3_5_model import KINDS, hf_greedy, tiny_model_dir
from support.qwen3_next_model import drive

VOCAB = 49152
FIVE = (1, 17, 70, 130, 200)


def prompts(lengths=FIVE) -> list[list[int]]:
    g = torch.Generator().manual_seed(35)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def reference(kind: str, lengths: tuple[int, ...], new_tokens: int) -> tuple[list[int], ...]:
    return tuple(hf_greedy(kind, prompts(lengths), new_tokens))


def run(kind: str, prompt_ids: list[list[int]], new_tokens: int, **config) -> tuple[list[list[int]], dict]:
    """Greedy tokens of the prompts submitted together, and the engine's usage once they finished."""
    config = dict(device_type="cpu", dtype="float32") | config
    with lmport.pipeline(tiny_model_dir(kind), backend_config=EngineConfig(**config)) as pipe:
        out = pipe.generate(prompt_ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))
        usage = pipe.engine.usage()
        pool = pipe.engine.scheduler.state_pool
        assert pool is not None and pool.num_free == pool.num_slots, "every state slot is free once all finished"
    assert usage["blocks_used"] == 0, "every block must be free once all requests finished"
    return [r.token_ids for r in out], usage


# The default run: the engine on the dense image-text directory, the model alone on the MoE one; the slow run
# each way on both.
@pytest.mark.parametrize("kind", [pytest.param("dense"), pytest.param("moe", marks=pytest.mark.slow)])
def test_engine_matches_transformers_chunked_and_batched(kind):
    # Chunks of 24 tokens over blocks of 16: chunks end inside blocks; the three requests share steps.
    lengths = (1, 20, 45)
    got, _ = run(kind, prompts(lengths), 6, block_size=16, max_prefill_token_num=24)
    assert got == list(reference(kind, lengths, 6))


@pytest.mark.parametrize("kind", [pytest.param("dense", marks=pytest.mark.slow), pytest.param("moe")])
def test_model_matches_transformers_with_chunks_and_slots(kind):
    lengths = (1, 20, 45)
    got = drive(tiny_model_dir(kind), prompts(lengths), 6, block_size=16, chunk=24)
    assert got == list(reference(kind, lengths, 6))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_model_matches_transformers_on_five_prompts(kind, block_size):
    assert drive(tiny_model_dir(kind), prompts(), 24, block_size, chunk=48) == list(reference(kind, FIVE, 24))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_engine_matches_transformers_on_five_prompts(kind, block_size):
    got, _ = run(kind, prompts(), 24, block_size=block_size, max_prefill_token_num=48)
    assert got == list(reference(kind, FIVE, 24))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_engine_matches_transformers_after_preemption(kind):
    # 30 blocks of 16 for five sequences of 1 + 17 + 70 + 130 + 200 + 5 x 24 tokens: some are preempted, their
    # state slots freed, and recomputed from their first token.
    got, usage = run(kind, prompts(), 24, block_size=16, max_prefill_token_num=64, cache_max_entry_count=30)
    assert usage["preemptions"] > 0
    assert got == list(reference(kind, FIVE, 24))


def test_the_image_text_config_is_read_as_its_text_model():
    """The released directory's config.json is ``qwen3_5`` with a ``text_config``: planning, the capability and
    tensor-parallel checks and the model all see the text model's config."""
    import json
    from pathlib import Path

    from lmport.models.architectures import cache_kinds, recurrent_state
    from lmport.models.loader import read_model_config
    path = tiny_model_dir("dense")
    saved = json.loads((Path(path) / "config.json").read_text())
    assert saved["model_type"] == "qwen3_5" and "vision_config" in saved
    cfg = read_model_config(path)
    assert cfg.model_type == "qwen3_5_text"
    assert len(cache_kinds(cfg)) == 1   # one full-attention layer of four keeps paged K/V
    spec = recurrent_state(cfg, torch.float32)
    assert spec is not None and spec.num_layers == 3


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallelism_is_refused_before_loading(kind, monkeypatch):
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded before the tensor-parallel check"))
    with pytest.raises(ConfigError, match="linear-attention layers are not split over ranks"):
        lmport.pipeline(tiny_model_dir(kind), backend_config=EngineConfig(device_type="cpu", dtype="float32", tp=2))
