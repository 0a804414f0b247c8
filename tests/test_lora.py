"""Multi-LoRA serving in the engine against transformers + peft.

Tiny Llama and Qwen3 models (tests/models.py) with peft adapters of rank 8 and 16 on q/k/v/o and
gate/up/down (random A and B, tests/support/lora_adapters.py): requests of both adapters and of the
base model run in one engine, batched together, and each request's greedy tokens equal transformers'
generate on the base model with that adapter merged by peft. Then: prefix-cache keys carry the
adapter, unloading while requests run loses none of them, and bad adapters are refused naming the field.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmport import EngineConfig, GenerationConfig
from lmport.config import ConfigError
from lmport.engine.engine import Engine
from lmport.lora import AdapterError
from lmport.platform.resolution import resolve_config
from support.model_helpers import hf_model, tiny_model_dir
from support.lora_adapters import adapter_dir, greedy, merged_model

NEW_TOKENS = 8
GEN = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 9, 40)]


def engine(model_dir: str, **config) -> Engine:
    config = {"device_type": "cpu", "dtype": "float32", "cache_max_entry_count": 128, "max_loras": 2,
              "max_lora_rank": 16, **config}
    return Engine(model_dir, EngineConfig(**config))


def run(eng: Engine, requests: list[tuple[list[int], str | None]], gen=GEN) -> list:
    """Adds every request at once (so they share steps), then steps until all end; their final outputs."""
    ids = [eng.add_request(p, gen, adapter=a) for p, a in requests]
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_mixed_batch_matches_transformers_peft(arch):
    model_dir = tiny_model_dir(arch)
    adapters = {"r8": adapter_dir(model_dir, 8, seed=1), "r16": adapter_dir(model_dir, 16, seed=2)}
    eng = engine(model_dir)
    try:
        for name, path in adapters.items():
            eng.load_adapter(name, path)
        requests = [(p, a) for p in prompts() for a in (None, "r8", "r16")]
        outs = run(eng, requests)
        assert eng.stats["steps"] < len(requests) * NEW_TOKENS   # batched, not one request after another
        assert eng.usage()["blocks_used"] == 0
    finally:
        eng.close()
    want = {None: greedy(hf_model(model_dir), prompts(), NEW_TOKENS)}
    for name, path in adapters.items():
        want[name] = greedy(merged_model(model_dir, path), prompts(), NEW_TOKENS)
    assert want["r8"] != want[None] and want["r16"] != want[None]   # the adapters change the output
    for (p, a), out in zip(requests, outs):
        assert out.finish_reason == "length" and out.token_ids == want[a][prompts().index(p)], (a, len(p))


def test_prefix_cache_keys_carry_the_adapter():
    model_dir = tiny_model_dir("llama")
    path = adapter_dir(model_dir, 8, seed=1)
    prompt = prompts()[2]   # 40 tokens: 2 full blocks of 16
    eng = engine(model_dir, enable_prefix_caching=True, block_size=16)
    try:
        eng.load_adapter("r8", path)
        base = run(eng, [(prompt, None)])[0]
        with_adapter = run(eng, [(prompt, "r8")])[0]
        again = run(eng, [(prompt, "r8")])[0]
    finally:
        eng.close()
    assert base.cached_tokens == 0 and with_adapter.cached_tokens == 0   # the base's blocks are not reused
    assert again.cached_tokens == 32 and again.token_ids == with_adapter.token_ids
    assert with_adapter.token_ids == greedy(merged_model(model_dir, path), [prompt], NEW_TOKENS)[0]


@pytest.mark.slow   # tests/test_server_lora.py unloads under load too, in the quick set
def test_unload_under_load_loses_no_request():
    model_dir = tiny_model_dir("llama")
    r8, r16 = adapter_dir(model_dir, 8, seed=1), adapter_dir(model_dir, 16, seed=2)
    long_gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    eng = engine(model_dir, max_loras=1)
    try:
        eng.load_adapter("a", r8)
        ids = [eng.add_request(p, long_gen, adapter=a) for p in prompts() for a in (None, "a")]
        outs: dict[str, list] = {i: [] for i in ids}
        for _ in range(3):
            for out in eng.step():
                outs[out.request_id].append(out)
        eng.unload_adapter("a")   # while its requests run
        with pytest.raises(AdapterError) as err:
            eng.add_request(prompts()[0], GEN, adapter="a")
        assert err.value.param == "model" and err.value.status == 404
        with pytest.raises(AdapterError) as err:   # its slot still serves the running requests
            eng.load_adapter("b", r16)
        assert err.value.status == 409 and "max_loras=1" in str(err.value)
        while eng.has_unfinished():
            for out in eng.step():
                outs[out.request_id].append(out)
        eng.load_adapter("b", r16)   # the slot is free once they ended
        (b_out,) = run(eng, [(prompts()[1], "b")])
    finally:
        eng.close()
    finals = [outs[i][-1] for i in ids]
    assert all(o.finished and o.finish_reason == "length" and len(o.token_ids) == 16 for o in finals)
    want = greedy(merged_model(model_dir, r8), prompts(), 16)
    assert [o.token_ids for o in finals[1::2]] == want
    assert b_out.token_ids == greedy(merged_model(model_dir, r16), [prompts()[1]], NEW_TOKENS)[0]


def _corrupt(tmp_path: Path, source: str, name: str, edit) -> str:
    target = tmp_path / name
    target.mkdir()
    for f in Path(source).iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    edit(target)
    return str(target)


def test_bad_adapters_are_refused_naming_the_field(tmp_path):
    model_dir = tiny_model_dir("llama")
    good = adapter_dir(model_dir, 8, seed=1)
    eng = engine(model_dir, max_lora_rank=8)
    try:
        def refused(name, path, param="lora_path", status=400):
            with pytest.raises(AdapterError) as err:
                eng.load_adapter(name, path)
            assert err.value.param == param and err.value.status == status, err.value
            return str(err.value)

        assert "above max_lora_rank=8" in refused("big", adapter_dir(model_dir, 16, seed=2))
        truncated = _corrupt(tmp_path, good, "truncated", lambda d: (d / "adapter_model.safetensors").write_bytes(
            (d / "adapter_model.safetensors").read_bytes()[:1000]))
        assert "cannot be read" in refused("t", truncated)
        bad_json = _corrupt(tmp_path, good, "json", lambda d: (d / "adapter_config.json").write_text("{r: 8"))
        assert "adapter_config.json" in refused("j", bad_json)
        assert "not a directory" in refused("missing", str(tmp_path / "nowhere"))
        dora = _corrupt(tmp_path, good, "dora", lambda d: (d / "adapter_config.json").write_text(
            json.dumps({**json.loads((d / "adapter_config.json").read_text()), "use_dora": True})))
        assert "use_dora" in refused("d", dora)
        assert "lm_head" in refused("head", adapter_dir(model_dir, 8, seed=3, targets=("q_proj", "lm_head")))
        other = adapter_dir(tiny_model_dir("qwen3"), 8, seed=1)   # another model's shapes
        assert "another base model" in refused("other", other)
        eng.load_adapter("ok", good)
        assert "already loaded" in refused("ok", good, param="lora_name", status=409)
        with pytest.raises(AdapterError) as err:
            eng.add_request(prompts()[0], GEN, adapter="nope")
        assert err.value.param == "model" and err.value.status == 404
        assert eng.usage()["running"] == 0 and eng.usage()["waiting"] == 0
    finally:
        eng.close()


def test_config():
    with pytest.raises(ConfigError, match="tp=1 only"):
        EngineConfig(device_type="cpu", max_loras=1, tp=2)
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineConfig(device_type="cpu", max_loras=1, max_lora_rank=0)
    resolved = resolve_config(EngineConfig(device_type="cuda", max_loras=2, eager_mode=False))
    assert resolved.eager_mode and [a.field for a in resolved.adjustments] == ["eager_mode"]
    eng = engine(tiny_model_dir("llama"), max_loras=0)
    try:
        with pytest.raises(AdapterError, match="max_loras=0"):
            eng.load_adapter("a", adapter_dir(tiny_model_dir("llama"), 8, seed=1))
    finally:
        eng.close()


def test_plan_counts_adapter_memory():
    from lmport.memory.plan import build_plan
    from lmport.memory.plan_format import format_plan
    model_dir = tiny_model_dir("llama")
    config = dict(device_type="cpu", dtype="float32", cache_max_entry_count=0.5)
    without = build_plan(model_dir, EngineConfig(**config), device_memory=2**30)
    with_lora = build_plan(model_dir, EngineConfig(**config, max_loras=3, max_lora_rank=16), device_memory=2**30)
    eng = engine(model_dir, max_loras=3)
    try:
        held = eng.runner.allocation()["lora_bytes"]
        measured = sum(b.nbytes for name, b in eng.model.named_buffers() if name.endswith(("lora_a", "lora_b")))
    finally:
        eng.close()
    assert without["lora"]["bytes"] == 0 and with_lora["lora"]["bytes"] == held == measured > 0
    assert without["free_after_weights_bytes"] - with_lora["free_after_weights_bytes"] == held
    assert "3 adapter slots of rank <= 16" in format_plan(with_lora)
