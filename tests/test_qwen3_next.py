"""Qwen3-Next (lmport.models.qwen3_next) against transformers' Qwen3NextForCausalLM (float32, greedy) on a tiny
random-weight model saved as a directory: the model driven step by step over its paged cache and state slots,
and the engine (chunked prefill across block boundaries, a batch of requests, preemption by recompute). Also:
the backends that do not declare the recurrent-state capability refuse the model before loading; prefix caching
is off for it; `lmport plan` of Qwen3-Next-80B-A3B's config.json gives the hand calculation of docs/engine.md."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import lmport
from lmport.config import EngineConfig, GenerationConfig
from lmport.errors import ConfigError
from support.qwen3_next_model import drive, hf_greedy, tiny_model_dir

# transformers' Qwen3NextConfig() saved: Qwen3-Next-80B-A3B's shape (test_real_config_is_transformers_defaults)
REAL_CONFIG_DIR = Path(__file__).parent / "data" / "qwen3_next"
VOCAB = 49152


def prompts(lengths=(1, 17, 70, 130, 200)) -> list[list[int]]:
    g = torch.Generator().manual_seed(61)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def reference(lengths: tuple[int, ...], new_tokens: int) -> tuple[list[int], ...]:
    return tuple(hf_greedy(tiny_model_dir(), prompts(lengths), new_tokens))


@pytest.mark.slow
def test_model_matches_transformers_with_chunks_and_slots():
    lengths = (1, 20, 45)
    assert drive(tiny_model_dir(), prompts(lengths), 6, block_size=16, chunk=24) == list(reference(lengths, 6))


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 64])
def test_model_matches_transformers_on_five_prompts(block_size):
    assert drive(tiny_model_dir(), prompts(), 24, block_size, chunk=48) == list(reference((1, 17, 70, 130, 200), 24))


def run(prompt_ids: list[list[int]], new_tokens: int, **config) -> tuple[list[list[int]], dict]:
    """Greedy tokens of the prompts submitted together, and the engine's usage once they finished."""
    config = dict(device_type="cpu", dtype="float32") | config
    with lmport.pipeline(tiny_model_dir(), backend_config=EngineConfig(**config)) as pipe:
        out = pipe.generate(prompt_ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))
        usage = pipe.engine.usage()
        pool = pipe.engine.scheduler.state_pool
        assert pool is not None and pool.num_free == pool.num_slots, "every state slot is free once all finished"
    assert usage["blocks_used"] == 0, "every block must be free once all requests finished"
    return [r.token_ids for r in out], usage


def test_engine_matches_transformers_chunked_and_batched():
    # Chunks of 24 tokens over blocks of 16: chunks end inside blocks; the three requests share steps.
    lengths = (1, 20, 45)
    got, _ = run(prompts(lengths), 6, block_size=16, max_prefill_token_num=24)
    assert got == list(reference(lengths, 6))


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 64])
def test_engine_matches_transformers_on_five_prompts(block_size):
    got, _ = run(prompts(), 24, block_size=block_size, max_prefill_token_num=48)
    assert got == list(reference((1, 17, 70, 130, 200), 24))


@pytest.mark.slow
def test_engine_matches_transformers_after_preemption():
    # 30 blocks of 16 (480 tokens) for five sequences of 1 + 17 + 70 + 130 + 200 + 5 x 24 tokens: some are
    # preempted, their state slots freed, and recomputed from their first token.
    got, usage = run(prompts(), 24, block_size=16, max_prefill_token_num=64, cache_max_entry_count=30)
    assert usage["preemptions"] > 0
    assert got == list(reference((1, 17, 70, 130, 200), 24))


def test_prefix_caching_is_off_for_the_hybrid_model(caplog):
    with caplog.at_level("WARNING"):
        with lmport.pipeline(tiny_model_dir(), backend_config=EngineConfig(
                device_type="cpu", dtype="float32", enable_prefix_caching=True)) as pipe:
            assert pipe.engine.block_manager.cache is None
    assert any("prefix caching is off" in r.getMessage() and "qwen3_next" in r.getMessage() for r in caplog.records)


def test_backends_declare_whether_they_run_recurrent_state():
    from lmport.backends.ascend import AscendBackend
    from lmport.backends.camb import CambBackend
    from lmport.backends.cpu import CpuBackend
    from lmport.backends.cuda import CudaBackend
    for backend in (CpuBackend, CudaBackend):
        assert "recurrent_state" in backend.capabilities.attention_variants
    for backend in (AscendBackend, CambBackend):
        assert "recurrent_state" not in backend.capabilities.attention_variants


def test_a_backend_without_recurrent_state_refuses_before_loading(monkeypatch):
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded before the capability check"))
    with pytest.raises(ConfigError, match="'qwen3_next' needs attention recurrent_state, which device 'ascend' "
                                          r"does not run .* run on .*cuda"):
        from lmport.memory.plan import build_plan
        build_plan(str(REAL_CONFIG_DIR), EngineConfig(device_type="ascend"), device_memory=2 << 40)


def test_tensor_parallelism_is_refused():
    from lmport.models.qwen3_next import Qwen3NextCausalLM
    from lmport.parallel import TPGroup
    from support.qwen3_next_model import tiny_config
    with torch.device("meta"), pytest.raises(ValueError, match="tensor parallelism"):
        Qwen3NextCausalLM(tiny_config(), backend=None, rotary=None, tp=TPGroup(0, 2))   # pyright: ignore[reportArgumentType]


def test_plan_of_qwen3_next_80b_real_config():
    """docs/engine.md's hand calculation: 12 full-attention layers of 2 KV heads x 256 (K and V, bfloat16) a token;
    36 linear layers, each a conv window of (2 x 16 x 128 + 32 x 128) channels x 3 (bfloat16) and 32 state
    matrices of 128 x 128 (float32), a sequence."""
    from lmport.memory.plan import build_plan
    from lmport.memory.plan_format import format_plan
    report = build_plan(str(REAL_CONFIG_DIR), EngineConfig(device_type="cpu", dtype="bfloat16", block_size=64,
                                                           max_batch_size=32), device_memory=2 << 40)
    kv, state = report["kv"], report["state"]
    assert kv["bytes_per_token"] == 12 * 2 * 2 * 256 * 2 == 24576
    assert kv["kinds"] == [{"kind": "kv", "heads": 2, "head_dim": 256, "layers": 12, "tensors": 2,
                            "bytes_per_token": 24576.0}]
    conv, matrices = 8192 * 3 * 2, 32 * 128 * 128 * 4
    assert (state["conv_bytes_per_layer"], state["state_bytes_per_layer"]) == (conv, matrices)
    assert state["bytes_per_sequence"] == 36 * (conv + matrices) == 77266944
    assert state["bytes"] == 32 * 77266944
    # the slots are taken before the cache's share
    reserve = report["activation_reserve"]["bytes"]
    assert report["usable_for_cache_bytes"] == report["free_after_weights_bytes"] - reserve - state["bytes"]
    assert "= 77,266,944 B a sequence x 32 slots" in format_plan(report)


def test_speculative_decoding_is_refused_before_loading(monkeypatch):
    from lmport.config import SpeculativeConfig
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match="speculative decoding is not supported for qwen3_next"):
        lmport.pipeline(tiny_model_dir(), backend_config=EngineConfig(device_type="cpu", dtype="float32",
                                                                      speculative=SpeculativeConfig()))


def test_a_step_without_slots_is_refused_once_a_sequence_continues():
    """The model never runs a continuing sequence from zeros: without its slot the step fails, naming why."""
    from lmport.backends.cpu import CpuBackend
    from lmport.kv.layout import KVLayout
    from lmport.models.loader import load_model
    from lmport.ops import build_attention_metadata
    model = load_model(tiny_model_dir(), CpuBackend(), torch.float32).model
    kinds = model.cache_kinds(model.config)
    caches = KVLayout(len(kinds), kinds[0].num_heads, kinds[0].head_dim, 16, torch.float32,
                      layer_kinds=kinds).allocate(2, "cpu")
    with pytest.raises(ValueError, match="recurrent-state slot"):
        model(torch.tensor([5]), build_attention_metadata([1], [4], [[0]], 16), caches)


def test_real_config_is_transformers_defaults():
    """The fixture is transformers' Qwen3NextConfig() as saved, whose docstring gives Qwen3-Next-80B-A3B's shape:
    every field the plan's figures read (layer types, KV heads, head dim, the linear layers' heads and dims) is
    the defaults'."""
    import json

    import transformers
    ours, defaults = json.loads((REAL_CONFIG_DIR / "config.json").read_text()), transformers.Qwen3NextConfig()
    for key in ("num_hidden_layers", "layer_types", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size"):
        assert ours[key] == getattr(defaults, key), key
