"""Sliding-window attention: the ops honour each layer's window, the blocks behind it are freed, and a
Mistral and a Gemma 2 with a 32-token window generate transformers' greedy tokens past the window.

The engine case runs 200-token prompts and 64 new tokens with chunked prefill (64-token chunks) and a
cache too small for every sequence at once (preemption), and asserts after every step that no sequence
holds more blocks than the window bound (lmport.kv.window.blocks_bound).
"""
from __future__ import annotations

import math

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig, ops
from lmport.kv.layout import KVLayout
from lmport.models.windows import kv_window, layer_windows
from lmport.kv.block_manager import BlockManager
from lmport.kv.window import HOLE, blocks_bound, first_kept_block
from lmport.sched.sequence import Sequence
from support.paging_invariants import check_block_manager
from support.model_helpers import hf_greedy, hf_model, logits_in_chunks, tiny_model_dir
from support.scheduler_workload import maybe_abort, run_batch

WINDOW = 32


def _dense(q, k, v, first_pos: int, window: int | None, scale: float) -> torch.Tensor:
    """Attention of q rows at positions first_pos.. over k/v at positions 0.., one token at a time."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = []
    for i in range(q.shape[0]):
        p = first_pos + i
        lo = 0 if window is None else max(0, p - window + 1)
        s = torch.einsum("hd,jhd->hj", q[i], k[lo:p + 1]) * scale
        out.append(torch.einsum("hj,jhd->hd", s.softmax(-1), v[lo:p + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 1, 5, 32])
def test_reference_op_matches_dense_attention(window):
    g = torch.Generator().manual_seed(0)
    bs, heads, kv_heads, d = 16, 4, 2, 32
    kv_lens, q_lens = [100, 37, 70], [40, 1, 1]     # a chunk over history, two decodes
    counts = [-(-n // bs) for n in kv_lens]
    ids = (torch.randperm(sum(counts), generator=g) + 1).tolist()
    tables = [ids[sum(counts[:i]):sum(counts[:i + 1])] for i in range(3)]
    cache = KVLayout(1, kv_heads, d, bs, torch.float32, 0).allocate(sum(counts) + 1, "cpu")[0]
    k, v = (torch.randn(sum(kv_lens), kv_heads, d, generator=g) for _ in range(2))
    ops.fill_kv_cache(k, v, cache, ops.build_attention_metadata(kv_lens, kv_lens, tables, bs).slot_mapping)
    meta = ops.build_attention_metadata(q_lens, kv_lens, tables, bs).for_layer(window)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    out = ops.paged_attention(q, cache, meta, 1 / math.sqrt(d))
    at = qs = 0
    for n_q, n_kv in zip(q_lens, kv_lens):
        want = _dense(q[qs:qs + n_q], k[at:at + n_kv], v[at:at + n_kv], n_kv - n_q, window, 1 / math.sqrt(d))
        torch.testing.assert_close(out[qs:qs + n_q], want, atol=2e-5, rtol=2e-5)
        at, qs = at + n_kv, qs + n_q


def test_freed_blocks_are_read_as_block_zero_behind_the_mask():
    meta = ops.build_attention_metadata([1], [40], [[HOLE, HOLE, 5]], 16)
    assert meta.block_tables.tolist() == [[0, 0, 5]]


def test_layer_windows_from_the_config():
    import transformers
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=32)
    assert layer_windows(mistral) == (32, 32, 32) and kv_window(mistral) == 32
    assert kv_window(transformers.MistralConfig(num_hidden_layers=3, sliding_window=None)) is None
    qwen2 = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                     max_window_layers=2)
    assert layer_windows(qwen2) == (None, None, 64, 64) and kv_window(qwen2) is None  # some layers read all
    assert layer_windows(transformers.LlamaConfig(num_hidden_layers=2)) == (None, None)


@pytest.mark.parametrize("prefix_caching,host_blocks", [(False, 0), (True, 0), (True, 8)])
def test_block_manager_frees_blocks_behind_the_window(prefix_caching, host_blocks):
    bs, chunk = 4, 6
    bm = BlockManager(40, bs, enable_prefix_caching=prefix_caching, num_host_blocks=host_blocks,
                      bytes_per_block=1, flops_per_token=1e9, window=10)
    seqs = [Sequence(f"s{i}", list(range(100 * i, 100 * i + 60)), GenerationConfig()) for i in range(3)]
    bound = blocks_bound(10, bs, chunk)
    for seq in seqs:
        assert bm.admit(seq, chunk) is not None
        bm.release_outside_window(seq)
        seq.num_computed += min(chunk, seq.num_uncomputed)
    for step in range(12):
        for seq in seqs:
            if not seq.num_uncomputed:
                seq.output_ids.append(7)     # a generated token
            n = min(chunk, seq.num_uncomputed)
            bm.release_outside_window(seq)
            bm.allocate(seq, n)
            held = [b for b in seq.block_table if b != HOLE]
            assert len(held) <= bound
            first = next(i for i, b in enumerate(seq.block_table) if b != HOLE)
            assert all(b == HOLE for b in seq.block_table[:first])    # the holes are a prefix
            assert first == first_kept_block(seq.num_computed, 10, bs)   # exactly the blocks out of reach
            seq.num_computed += n
        check_block_manager(bm, seqs)
        if step == 5:   # preempt one; it is swapped out only where its holes lie in its prefix-cached blocks
            if not bm.preempt(seqs[1]):
                assert seqs[1].num_computed == 0
            assert prefix_caching or seqs[1].num_computed == 0
            assert bm.admit(seqs[1], chunk) is not None
    for seq in seqs:
        bm.free(seq)
    check_block_manager(bm, [])
    assert bm.num_free == 40


def run_engine(model_dir, prompts, new_tokens, **config):
    """Greedy tokens, and the most blocks any sequence held after any step."""
    cfg = EngineConfig(device_type="cpu", dtype="float32", **config)
    most = 0
    with lmport.pipeline(model_dir, backend_config=cfg) as pipe:
        engine = pipe.engine
        step = engine.step

        def counted_step():
            nonlocal most
            out = step()
            for seq in engine.scheduler.running:
                most = max(most, sum(b != HOLE for b in seq.block_table))
            return out
        engine.step = counted_step
        responses = pipe.generate(prompts, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))
        usage = engine.usage()
        assert usage["blocks_used"] == 0
    return [r.token_ids for r in responses], most, usage


def _prompts(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch,block_size", [("mistral-sw32", 16), pytest.param("gemma2", 16, marks=pytest.mark.slow),
                                             pytest.param("mistral-sw32", 64, marks=pytest.mark.slow)])
def test_window_32_matches_transformers_with_chunks_and_preemption(arch, block_size):
    model_dir = tiny_model_dir(arch)
    prompts = _prompts([200, 200, 200, 120])
    want = hf_greedy(model_dir, prompts, 64)
    chunk = 64
    if kv_window(hf_model(model_dir).config) is not None:
        # Every layer slides: a sequence holds at most the window's bound, and 264-token sequences
        # (17 blocks of 16 each) run in one block more than that only because the blocks behind the
        # window are freed.
        bound = blocks_bound(WINDOW, block_size, chunk)
    else:
        # Gemma 2's global layers read the whole history through the same block table: nothing is
        # freed, a sequence holds all its blocks.
        bound = -(-(200 + 64) // block_size)
    got, most, usage = run_engine(model_dir, prompts, 64, block_size=block_size,
                                  cache_max_entry_count=bound + 1, max_prefill_token_num=chunk)
    assert usage["preemptions"] > 0
    assert most <= bound
    assert got == want


def test_window_logits_in_three_chunks():
    model_dir = tiny_model_dir("mistral-sw32")
    (ids,) = _prompts([90], seed=9)
    pipe = lmport.pipeline(model_dir, backend_config=EngineConfig(device_type="cpu", cache_max_entry_count=64))
    engine = pipe.engine
    with torch.inference_mode():
        ref = hf_model(model_dir)(torch.tensor([ids])).logits[0]
    seq, logits = logits_in_chunks(engine, ids, 30)   # three chunks of 30
    assert sum(b == HOLE for b in seq.block_table) > 0   # the window freed blocks between the chunks
    torch.testing.assert_close(torch.cat(logits), ref, atol=2e-4, rtol=1e-4)
    pipe.close()


def test_plan_session_len_is_not_capped_by_the_window():
    from lmport.memory import plan
    from lmport.memory.plan_format import format_plan
    report = plan.build_plan(tiny_model_dir("mistral-sw32"), EngineConfig(device_type="cpu", block_size=16,
                                                                         cache_max_entry_count=20,
                                                                         max_prefill_token_num=64),
                             device_memory=1 << 30)
    cache = report["cache"]
    assert report["error"] is None
    assert cache["session_len"] == 2048 > cache["num_tokens"]      # the model's context, more than 20 blocks hold
    assert cache["blocks_per_sequence"] == cache["window_blocks"] == blocks_bound(WINDOW, 16, 64)
    assert "sliding window 32 on every layer" in format_plan(report)


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_a_window_prefix_cache_and_host_tier(seed):
    """Shared prefixes, preemption (swapped or recomputed), aborts and a window: the block accounting
    holds after every step, no sequence exceeds the window's bound, and every block comes back."""
    import random

    from lmport.sched.scheduler import Scheduler
    rng = random.Random(seed)
    bs, window, chunk = rng.choice([4, 16]), rng.choice([8, 33]), rng.choice([16, 48])
    bound = blocks_bound(window, bs, chunk)
    bm = BlockManager(bound + rng.randint(1, 3 * bound), bs, enable_prefix_caching=True,
                      num_host_blocks=rng.choice([0, 2 * bound]), bytes_per_block=1, flops_per_token=1e9,
                      window=window)
    scheduler = Scheduler(bm, max_batch_size=8, max_prefill_token_num=chunk)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(20, 90))] for _ in range(3)]
    seqs = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 60))]
        seqs.append(Sequence(f"r{i}", prompt, GenerationConfig()))
        scheduler.add(seqs[-1])
    targets = {s.request_id: rng.randint(1, 80) for s in seqs}
    steps = 0
    while scheduler.has_unfinished():
        steps += 1
        assert steps < 20_000
        batch = scheduler.schedule()
        bm.take_copies()
        for seq in batch.seqs:
            assert sum(b != HOLE for b in seq.block_table) <= bound
        run_batch(scheduler, batch, rng, targets)
        maybe_abort(scheduler, seqs, rng, 0.03)
        check_block_manager(bm, scheduler.running)
    assert bm.allocator.num_free + bm.allocator.num_cached == bm.num_blocks


def test_prefix_caching_is_off_where_every_layer_slides(caplog):
    cfg = EngineConfig(device_type="cpu", cache_max_entry_count=32, enable_prefix_caching=True)
    with lmport.pipeline(tiny_model_dir("mistral-sw32"), backend_config=cfg) as pipe:
        assert pipe.engine.usage()["prefix_caching"] is False
        assert pipe.engine.block_manager.window == WINDOW
    assert "prefix caching is off: every layer of mistral slides over 32 tokens" in caplog.text
    with lmport.pipeline(tiny_model_dir("gemma2"), backend_config=cfg) as pipe:   # global layers: nothing freed
        assert pipe.engine.usage()["prefix_caching"] is True and pipe.engine.block_manager.window is None
