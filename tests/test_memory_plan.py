"""`lmport plan`: reads only the config, and its numbers are the ones the engine really allocates."""
from __future__ import annotations

import dataclasses
import functools
import json
from unittest import mock

import pytest
import torch
import transformers

from lmport import units

from lmport.entrypoints import cli

from lmport.memory import budget as memory, plan
from lmport.backends.cpu import CpuBackend
from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.models import loader
from lmport.platform.resolution import resolve_config
from lmport.weights import gguf as gguf_weights
from lmport.weights.gguf_header import GGUFHeader
from support.model_helpers import default_model_path, tiny_model_dir
from test_get_ppl import CONFIG, FREE, smollm2_pipeline


@pytest.fixture
def run_plan(capsys):
    """``run_plan(*argv)`` -> (exit code, stdout) of `lmport plan ARGV` in this process."""
    def run(*argv) -> tuple[int, str]:
        code = cli.main(["plan", *map(str, argv)])
        return code, capsys.readouterr().out
    return run


def test_smollm2_plan_reads_no_weights_and_matches_the_engine(monkeypatch):
    engine = smollm2_pipeline().engine      # started with FREE bytes free once its weights were loaded
    # Fresh caches for this test (the engine read the config and header already): the plan reads the file itself.
    fresh_config = functools.cache(loader.read_model_config.__wrapped__)
    monkeypatch.setattr(loader, "read_model_config", fresh_config)
    monkeypatch.setattr(plan, "read_model_config", fresh_config)
    monkeypatch.setattr(gguf_weights, "_read", functools.lru_cache(maxsize=4)(gguf_weights._read.__wrapped__))
    headers = []
    read_header = gguf_weights.read_header
    monkeypatch.setattr(gguf_weights, "read_header", lambda path, *a: headers.append(path) or read_header(path, *a))

    def no_weights(*args, **kwargs):
        raise AssertionError("lmport plan must not load or convert weights")

    monkeypatch.setattr(GGUFHeader, "data", no_weights)   # every tensor's bytes are read through it
    monkeypatch.setattr(loader, "load_model", no_weights)
    monkeypatch.setattr(gguf_weights, "load_tensors", no_weights)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    report = plan.build_plan("smollm2", CONFIG, device_memory=FREE + engine.weight_bytes)
    assert headers == [loader.resolve_model_path("smollm2")]   # the GGUF's header, read once; no tensor

    assert report["weights"]["bytes"] == engine.weight_bytes
    assert report["weights"]["bytes_by_dtype"] == {"float32": engine.weight_bytes}
    assert report["free_after_weights_bytes"] == FREE == engine.plan.free_bytes
    assert report["activation_reserve"]["bytes"] == engine.plan.reserve_bytes
    assert report["kv"]["bytes_per_block"] == engine.layout.bytes_per_block
    cache = report["cache"]
    assert cache["num_blocks"] == engine.plan.num_blocks == engine.caches[0].k.shape[0]
    assert engine.block_manager.num_blocks == cache["num_blocks"]
    assert cache["session_len"] == engine.session_len
    assert cache["bytes"] == sum(t.numel() * t.element_size() for c in engine.caches for t in (c.k, c.v))
    # The float's meaning: a share of what is free after weights and the reserve.
    assert cache["num_blocks"] == int((FREE - engine.plan.reserve_bytes) * 0.05) // engine.layout.bytes_per_block


@pytest.mark.parametrize("config", [
    EngineConfig(device_type="cpu", cache_max_entry_count=37),
    EngineConfig(device_type="cpu", cache_max_entry_count=0.001, quant_policy=8, block_size=32),
    EngineConfig(device_type="cpu", cache_max_entry_count=0.002, quant_policy=4, session_len=256,
                 max_prefill_token_num=512),
    EngineConfig(device_type="cpu", cache_max_entry_count=0.001, kv_cache_dtype="float16"),
])
def test_tiny_model_plan_matches_the_engine(config):
    model = tiny_model_dir("llama")
    free = 256 << 20
    with mock.patch.object(CpuBackend, "memory_info", lambda self: (free, free)):
        engine = Engine(model, config)
    report = plan.build_plan(model, config, device_memory=free + engine.weight_bytes)
    assert report["weights"]["bytes"] == engine.weight_bytes
    assert report["cache"]["num_blocks"] == engine.plan.num_blocks == engine.caches[0].k.shape[0]
    assert report["cache"]["session_len"] == engine.session_len
    assert report["kv"]["bytes_per_block"] == engine.layout.bytes_per_block
    if isinstance(config.cache_max_entry_count, int):
        assert engine.plan.num_blocks == config.cache_max_entry_count
    if config.kv_cache_dtype == "float16":   # half a float32 cache's bytes a block: twice the blocks
        assert engine.caches[0].k.dtype == torch.float16
        f32 = plan.build_plan(model, dataclasses.replace(config, kv_cache_dtype="auto"),
                              device_memory=free + engine.weight_bytes)
        assert report["kv"]["bytes_per_block"] * 2 == f32["kv"]["bytes_per_block"]


@pytest.mark.parametrize("model", ["gemma3", "smollm2"])
def test_a_tied_head_stays_one_tensor_on_the_device(model):
    """The plan counts a tied LM head once; so must the device. Module.to moves each parameter and buffer on
    its own (a copy, as a move to a GPU is): the tied head would be held twice, as it was on an H100. The loader
    moves shared tensors once. A clone stands in for the device move here."""
    from lmport.models.loader import load_model, move_keeping_shared, resident_bytes
    path = tiny_model_dir("gemma3") if model == "gemma3" else "smollm2"   # float tensors / the GGUF's blocks
    loaded = load_model(path, CpuBackend(), torch.float32)
    embed = loaded.config.vocab_size * loaded.config.hidden_size
    assert loaded.weight_bytes == resident_bytes(loaded.model)
    twice = load_model(path, CpuBackend(), torch.float32).model
    twice._apply(lambda t: t.clone())
    assert resident_bytes(twice) > loaded.weight_bytes + embed // 8   # what Module.to does: the head twice
    move_keeping_shared(loaded.model, lambda t: t.clone())
    assert resident_bytes(loaded.model) == loaded.weight_bytes
    assert loaded.model.lm_head.forward(torch.ones(1, loaded.config.hidden_size)).shape[-1] == loaded.config.vocab_size


@pytest.mark.parametrize("model_cfg,window_blocks", [
    (transformers.MistralConfig(sliding_window=4096, max_position_embeddings=32768), -(-(4095 + 8192) // 16) + 1),
    (transformers.MistralConfig(sliding_window=None, max_position_embeddings=32768), None),
    # Only some layers slide (layers from max_window_layers on): every block stays readable.
    (transformers.Qwen2Config(use_sliding_window=True, sliding_window=1024, max_position_embeddings=32768,
                              num_hidden_layers=4, max_window_layers=2), None),
    (transformers.Qwen2Config(sliding_window=1024, max_position_embeddings=32768), None),  # window off
])
def test_a_sliding_window_bounds_the_blocks_not_the_session(model_cfg, window_blocks):
    # The attention ops honour the window, so the session is the model's context; where every layer
    # slides, the blocks behind the window are freed and a sequence never holds more than the bound.
    assert memory.model_limit(model_cfg) == 32768
    config = resolve_config(EngineConfig(device_type="cpu", cache_max_entry_count=1024, block_size=16,
                          max_prefill_token_num=8192))
    inputs = memory.MemoryInputs(model_cfg, config, CpuBackend.capabilities, 0, 64 << 40, 0, False)
    plan = memory.plan_cache(inputs)
    assert plan.window_blocks == window_blocks
    # 1024 blocks hold 16,384 tokens: the 32k context fits only where the window bounds a sequence's blocks.
    assert plan.session_len == (32768 if window_blocks else 1024 * 16)
    assert plan.blocks_per_sequence == (window_blocks or 1024)


def test_a_measured_reserve_replaces_the_estimate(monkeypatch):
    """Where the backend measures peak memory (cuda), one real forward of max_prefill_token_num tokens
    sets the reserve; the scratch cache it used is not counted."""
    runs = []

    def measure(self, fn):
        fn()
        runs.append(1)
        return 50 << 20

    monkeypatch.setattr(CpuBackend, "measure_peak_memory", measure)
    monkeypatch.setattr(CpuBackend, "memory_info", lambda self: (256 << 20, 256 << 20))
    engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", max_prefill_token_num=64,
                                                         cache_max_entry_count=0.1))
    scratch = 4 * engine.layout.bytes_per_block          # 64 tokens in blocks of 16
    assert runs == [1]
    assert engine.plan.reserve_measured and engine.plan.reserve_bytes == (50 << 20) - scratch
    usable = (256 << 20) - engine.plan.reserve_bytes
    assert engine.plan.num_blocks == int(usable * 0.1) // engine.layout.bytes_per_block


def test_cpu_says_it_uses_the_estimate(run_plan):
    code, out = run_plan(tiny_model_dir("llama"), "--device", "cpu", "--device-memory", "1GiB", "--json")
    report = json.loads(out)
    assert code == 0 and report["activation_reserve"]["source"] == "estimate"
    assert "cpu cannot measure" in report["activation_reserve"]["note"]


def test_planned_24gib_cuda_device_for_each_quant_policy(run_plan):
    """A device that is not here: resolved against the cuda backend's capabilities, not instantiated."""
    model = default_model_path()          # smollm2's converted config: same numbers, read fast
    reports = {}
    for q in (0, 8, 4, "fp8"):
        code, out = run_plan(model, "--device", "cuda", "--device-memory", "24GiB", "--quant-policy", q, "--json")
        assert code == 0, out
        reports[q] = json.loads(out)
    r0 = reports[0]
    assert r0["config"]["dtype"] == "bfloat16" and r0["config"]["block_size"] == 64
    assert r0["weights"]["bytes_by_dtype"] == {"bfloat16": r0["weights"]["parameters"] * 2}
    assert r0["activation_reserve"]["note"].startswith("the cuda engine measures it")
    # 30 layers x 3 KV heads x (K and V) per token: 64 bf16 values, 64 uint8, or 32 packed bytes + fp16 scale/zero.
    assert [reports[q]["kv"]["bytes_per_token"] for q in (0, 8, 4)] == [30 * 3 * 2 * 128, 30 * 3 * 2 * 68,
                                                                       30 * 3 * 2 * 36]
    usable = (24 << 30) - r0["weights"]["bytes"] - r0["activation_reserve"]["bytes"]
    for r in reports.values():
        assert r["usable_for_cache_bytes"] == usable
        assert r["cache"]["num_blocks"] == int(usable * 0.8) // r["kv"]["bytes_per_block"]
        assert r["cache"]["session_len"] == 8192
        assert r["cache"]["sequences_that_fit"] == r["cache"]["num_blocks"] // (8192 // 64)
        assert r["cache"]["max_concurrent_sequences"] == min(64, r["cache"]["sequences_that_fit"])
    assert reports[0]["cache"]["num_tokens"] < reports[8]["cache"]["num_tokens"] < reports[4]["cache"]["num_tokens"]
    # fp8: one byte a value and no per-row scale: exactly half of bf16's bytes, twice its blocks (up to rounding down).
    assert reports["fp8"]["kv"]["quant_policy"] == "fp8"
    assert reports["fp8"]["kv"]["bytes_per_token"] * 2 == reports[0]["kv"]["bytes_per_token"]
    assert reports["fp8"]["cache"]["num_blocks"] in (2 * reports[0]["cache"]["num_blocks"],
                                                     2 * reports[0]["cache"]["num_blocks"] + 1)


def test_text_output_names_every_figure(run_plan):
    code, out = run_plan(tiny_model_dir("llama"), "--device", "camb", "--device-memory", "2GiB", "--block-size", "64")
    assert code == 0
    for label in ("model", "device", "weights", "activation", "free", "KV cache", "session_len", "sequences",
                  "config", "adjustments"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "block_size: 64 -> 16 (camb requires block size 16)" in out


@pytest.mark.parametrize("text, size", [("24GiB", 24 << 30), ("24G", 24 << 30), ("24GB", 24 * 10**9),
                                        ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("1000", 1000)])
def test_parse_bytes(text, size):
    assert units.parse_bytes(text) == size


def test_estimate_scales_with_prefill_tokens_and_tp():
    cfg = plan.read_model_config(str(default_model_path()))
    base = resolve_config(EngineConfig(device_type="cuda"))
    small = resolve_config(EngineConfig(device_type="cuda", max_prefill_token_num=1024))
    split = resolve_config(EngineConfig(device_type="cuda", tp=3))
    assert memory.activation_reserve(cfg, small) < memory.activation_reserve(cfg, base)
    assert memory.activation_reserve(cfg, split) < memory.activation_reserve(cfg, base)
    assert memory.kv_layout(cfg, split).num_kv_heads == 1


def test_the_estimate_counts_latent_attention_per_head():
    """DeepSeek-V3's prefill (lmport.ops.mla, the projections absorbed) makes, per token: q [128 heads x (128 + 64)],
    its latent [128 x 512], that beside the rotary part [128 x (512 + 64)], the weighted sum of latents [128 x 512]
    and the values [128 x 128], beside the latent (512 + 64) and the query's latent (1536); its widest MLP is the
    dense layers' 18,432. Its config's head_dim is the rotary part's 64, which a q/k/v count of heads x head_dim
    would take for the whole head."""
    cfg = plan.read_model_config("tests/data/deepseek_v3")
    config = resolve_config(EngineConfig(device_type="cuda", dtype="bfloat16", max_prefill_token_num=4096,
                                         max_batch_size=8))
    attention = 128 * (192 + 512 + 576 + 512 + 128) + 512 + 64 + 1536
    per_token = 3 * 18432 + attention + 4 * 7168
    logits = 8 * 129280 * (2 + 12)
    assert memory.activation_reserve(cfg, config) == int((4096 * per_token * 2 + logits) * 1.25)


def test_the_estimate_of_a_model_with_experts_only():
    """Qwen3.5-MoE's text config has no dense MLP width (intermediate_size): its widest MLP is an expert or the
    shared expert."""
    cfg = transformers.Qwen3_5MoeTextConfig(moe_intermediate_size=512, shared_expert_intermediate_size=640)
    config = resolve_config(EngineConfig(device_type="cuda", dtype="bfloat16", max_prefill_token_num=1024,
                                         max_batch_size=4))
    per_token = 3 * 640 + 3 * cfg.num_attention_heads * cfg.head_dim + 4 * cfg.hidden_size
    logits = 4 * cfg.vocab_size * (2 + 12)
    assert memory.activation_reserve(cfg, config) == int((1024 * per_token * 2 + logits) * 1.25)


def test_the_runner_reports_the_recurrent_state_it_holds():
    """A hybrid model's runner holds a state slot per running sequence beside the paged cache: `allocation()`
    counts the bytes of those tensors, and they are what `lmport plan` plans for them."""
    from support.qwen3_next_model import tiny_model_dir as qwen3_next_dir
    config = EngineConfig(device_type="cpu", dtype="float32", max_batch_size=3, cache_max_entry_count=8)
    report = plan.build_plan(qwen3_next_dir(), config, device_memory=8 << 30)
    engine = Engine(qwen3_next_dir(), config)
    try:
        held = engine.executor.run_all("allocation")[0]
        states = engine.runner.states
        assert states is not None
        tensors = [*states.conv, *states.state]
        assert held["state_bytes"] == sum(t.numel() * t.element_size() for t in tensors)
        assert held["state_bytes"] == report["state"]["bytes"] == 3 * report["state"]["bytes_per_sequence"]
        assert (held["num_blocks"], held["cache_bytes"]) == (report["ranks"][0]["num_blocks"],
                                                               report["ranks"][0]["cache_bytes"])
    finally:
        engine.close()
