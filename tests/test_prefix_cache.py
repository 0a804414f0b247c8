"""Prefix caching and the host tier in the engine: greedy outputs are token-identical with prefix
caching off, on, and on with the host tier (tiny random-weight model; the default model in a slow case).
Block-manager invariants are checked after every engine step."""
from __future__ import annotations

import random

import pytest

import lmport
from lmport.config import EngineConfig, GenerationConfig
from support.paging_invariants import check_block_manager
from support.model_helpers import tiny_model_dir

SHARED_PROMPT_LEN = 1000


def run(model: str, prompts, max_new: int, quant_policy: int, hash_fn=None, **config):
    """Greedy outputs and the engine's usage(), checking the block manager after every step."""
    cfg = EngineConfig(device_type="cpu", dtype="float32", block_size=16, quant_policy=quant_policy, **config)
    with lmport.pipeline(model, backend_config=cfg) as pipe:
        engine = pipe.engine
        if hash_fn is not None:
            engine.block_manager.cache.hash_fn = hash_fn
        step = engine.step

        def checked_step():
            outputs = step()
            check_block_manager(engine.block_manager, engine.seqs.values())
            return outputs
        engine.step = checked_step
        responses = pipe.generate(prompts, GenerationConfig(max_new_tokens=max_new, ignore_eos=True))
        assert all(r.finish_reason == "length" for r in responses), [r.error for r in responses]
        return [r.token_ids for r in responses], engine.usage()


def shared_prompt_workload(n=64, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(3, 40000) for _ in range(SHARED_PROMPT_LEN)]
    return [system + [rng.randrange(3, 40000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def partial_overlap_workload(n=32, seed=1):
    """A few documents; each request takes a prefix of one, cut anywhere (not at a block boundary),
    plus its own question."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 40000) for _ in range(rng.randrange(150, 300))] for _ in range(5)]
    prompts = []
    for _ in range(n):
        doc = rng.choice(docs)
        prompts.append(doc[:rng.randrange(len(doc) // 3, len(doc) + 1)] +
                       [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 20))])
    return prompts


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_dir("llama")


# int8 pages under the prefix cache and the host tier run by default in test_partial_overlap_outputs_identical.
@pytest.mark.parametrize("quant_policy", [0, pytest.param(8, marks=pytest.mark.slow)])
def test_shared_system_prompt_outputs_identical(tiny, quant_policy):
    prompts = shared_prompt_workload(n=32)   # the cost is each 1,000-token prompt computed with the cache off
    off, _ = run(tiny, prompts, 4, quant_policy, cache_max_entry_count=4500)
    on, u_on = run(tiny, prompts, 4, quant_policy, cache_max_entry_count=4500, enable_prefix_caching=True)
    # A device pool smaller than the batch needs: preemptions, evictions to the host, swaps.
    host, u_host = run(tiny, prompts, 4, quant_policy, cache_max_entry_count=70, enable_prefix_caching=True,
                       host_cache_gib=0.02)
    assert on == off
    assert host == off
    per_request = (SHARED_PROMPT_LEN - 1) // 16
    assert u_on["prefix_cache_hit_blocks_device"] >= (len(prompts) - 8) * per_request
    assert u_host["prefix_cache_hit_rate"] > 0.8 and u_host["preemptions"] > 0
    assert u_host["blocks_to_host"] > 0 and u_host["blocks_from_host"] > 0


@pytest.mark.parametrize("quant_policy", [0, 4, 8])
def test_partial_overlap_outputs_identical(tiny, quant_policy):
    prompts = partial_overlap_workload()
    common = dict(max_batch_size=4, max_prefill_token_num=512)
    off, _ = run(tiny, prompts, 6, quant_policy, cache_max_entry_count=400, **common)
    on, u_on = run(tiny, prompts, 6, quant_policy, cache_max_entry_count=400, enable_prefix_caching=True, **common)
    # Too small a device cache for every document: prefixes go to the host and come back.
    host, u_host = run(tiny, prompts, 6, quant_policy, cache_max_entry_count=64, enable_prefix_caching=True,
                       host_cache_gib=0.02, **common)
    assert on == off
    assert host == off
    assert u_on["prefix_cache_hit_rate"] > 0.3
    assert u_host["prefix_cache_host_hit_rate"] > 0 and u_host["bytes_from_host"] > 0


def test_forced_hash_collisions_keep_outputs_identical(tiny):
    prompts = partial_overlap_workload(n=16, seed=2)
    off, _ = run(tiny, prompts, 4, 0, cache_max_entry_count=400)
    collide, usage = run(tiny, prompts, 4, 0, hash_fn=lambda parent, tokens, extra: bytes([tokens[0] % 2]),
                         cache_max_entry_count=64, enable_prefix_caching=True, host_cache_gib=0.02)
    assert collide == off
    assert usage["hash_collisions"] > 0


@pytest.mark.parametrize("quant_policy", [0, 8])
def test_a_prompt_cached_to_its_last_block_recomputes_one_token(tiny, quant_policy):
    """A prompt that ends a block, asked again: it goes on in a copy of its cached last block, computing only
    its last token, and generates what it generates uncached (a fresh engine)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 40000) for _ in range(16 * blocks)] for blocks in (1, 4, 7)]
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    off, _ = run(tiny, prompts, 6, quant_policy, cache_max_entry_count=400)
    cfg = EngineConfig(device_type="cpu", dtype="float32", block_size=16, quant_policy=quant_policy,
                       enable_prefix_caching=True, cache_max_entry_count=400)
    with lmport.pipeline(tiny, backend_config=cfg) as pipe:
        engine = pipe.engine

        def generate(round_: int) -> tuple[list[list[int]], list[int]]:
            """Each prompt's tokens and cached prompt tokens."""
            ids = [engine.add_request(p, gen, f"{round_}-{i}") for i, p in enumerate(prompts)]
            tokens, cached = {}, {}
            while len(cached) < len(ids):
                for out in engine.step():
                    tokens[out.request_id] = list(out.token_ids)   # all its tokens so far
                    if out.finished:
                        cached[out.request_id] = out.cached_tokens
            return [tokens[i] for i in ids], [cached[i] for i in ids]

        first, first_cached = generate(0)
        again, again_cached = generate(1)
    assert first == off and again == off
    assert first_cached == [0, 0, 0] and again_cached == [len(p) - 1 for p in prompts]


def test_cache_salt_and_cached_tokens(tiny):
    cfg = EngineConfig(device_type="cpu", dtype="float32", block_size=16, enable_prefix_caching=True)
    with lmport.pipeline(tiny, backend_config=cfg) as pipe:
        engine = pipe.engine
        prompt = list(range(100, 200))

        def cached(salt=None):
            rid = engine.add_request(prompt, GenerationConfig(max_new_tokens=1), cache_salt=salt)
            while True:
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        return out.cached_tokens
        assert cached() == 0
        assert cached() == 96                 # 6 full blocks; the 100th token is recomputed
        assert cached("tenant-a") == 0
        assert cached("tenant-a") == 96
        assert cached("tenant-b") == 0
        u = engine.usage()
        assert u["prefix_cache_hit_blocks_device"] == 12 and u["prefix_cache_miss_blocks"] == 18


@pytest.mark.slow
def test_shared_system_prompt_default_model():
    prompts = shared_prompt_workload()
    off, _ = run("smollm2", prompts, 8, 0, cache_max_entry_count=1200)
    on, _ = run("smollm2", prompts, 8, 0, cache_max_entry_count=1200, enable_prefix_caching=True)
    # As in the tiny case: a device pool small enough for preemptions, so prefixes go to the host and come back.
    host, u = run("smollm2", prompts, 8, 0, cache_max_entry_count=70, enable_prefix_caching=True,
                  host_cache_gib=0.5)
    assert on == off and host == off
    assert u["blocks_from_host"] > 0
