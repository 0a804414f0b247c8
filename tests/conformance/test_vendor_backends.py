"""ascend and camb: their ops against the reference ops, and their configuration rules.

``harness.op_backend`` runs each backend natively where its vendor stack imports
and a device is present, otherwise against the simulated SDK in tests/simulated
(CPU tensors, mode "simulated"). Every backend test records its mode as the
``mode`` property (``--junitxml`` shows it), so a simulated pass is never taken
for a pass on hardware. In simulated mode the tests also check, from the
simulation's call log, which vendor operator each op actually ran.

Cases: KV fill, decode and prefill-with-history attention (mixed batch with a
decode row, GQA, shuffled non-contiguous blocks) for ascend with quant_policy
0/8/4 and block sizes 16 and 128 (the page-attention and fallback paths), and
for camb with its forced block size 16 and "bhsd" cache; RMSNorm and rotary;
camb refusing quant_policy 4/8 at EngineConfig construction while ascend
accepts them; and a tiny random-weight model giving the cpu backend's greedy
tokens through the engine on each device.
"""
from __future__ import annotations

import math

import pytest
import torch

from lmport import ConfigError, EngineConfig, GenerationConfig, ops
from lmport.kv.layout import KVLayout, LayerCache
from lmport.platform.resolution import resolve_config
from support.model_helpers import tiny_model_dir

VENDORS = ("ascend", "camb")
HQ, HKV, D = 4, 2, 64          # GQA: two query heads a KV head
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# (device, quant_policy, block_size): every path of each backend.
CASES = [
    pytest.param("ascend", 0, 128, id="ascend-q0-bs128"),   # page attention for decode and prefill
    pytest.param("ascend", 0, 16, id="ascend-q0-bs16"),     # paged decode, gathered prefill
    pytest.param("ascend", 8, 128, id="ascend-q8-bs128"),   # INT8 antiquant decode, dequantized prefill
    pytest.param("ascend", 8, 16, id="ascend-q8-bs16"),
    pytest.param("ascend", 4, 128, id="ascend-q4-bs128"),   # INT4: the stated dequantize-then-FIA fallback
    pytest.param("ascend", 4, 16, id="ascend-q4-bs16"),
    pytest.param("camb", 0, 16, id="camb-q0-bs16"),
]


@pytest.fixture
def backend(request, backends, record_property):
    """(backend, mode, call log or None) for the test's device, with the mode recorded."""
    name = request.node.callspec.params["device"]
    backend, mode = backends(name)
    record_property("mode", mode)
    calls = _simulation(name).calls if mode == "simulated" else None
    if calls is not None:
        calls.clear()
    return backend, mode, calls


def _simulation(name):
    import simulated  # tests/ is on sys.path (tests/conftest.py), as for ``models``
    return simulated.module(name)


def _case(order: str, quant_policy: int, block: int, dtype, q_lens, kv_lens, seed=0):
    """Backend and reference (bshd) caches with every position of every sequence written, plus q."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block) for n in kv_lens]
    num_blocks = sum(need) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 pads the tables
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n])
        used += n
    caches = {o: KVLayout(1, HKV, D, block, dtype, quant_policy, o).allocate(num_blocks, "cpu")[0]
              for o in {order, "bshd"}}
    k = torch.randn(sum(kv_lens), HKV, D, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), HKV, D, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype)
    everything = ops.build_attention_metadata(kv_lens, kv_lens, tables, block)
    meta = ops.build_attention_metadata(q_lens, kv_lens, tables, block)
    return caches, k, v, q, everything, meta


def _to_device(cache: LayerCache, device) -> LayerCache:
    def move(t):
        return None if t is None else t.to(device)
    return LayerCache(move(cache.k), move(cache.v), move(cache.k_qparams), move(cache.v_qparams),
                      cache.quant_policy, cache.block_size, cache.axis_order)


def _meta_to(meta: ops.AttentionMetadata, device) -> ops.AttentionMetadata:
    return ops.build_attention_metadata(meta.q_lens.tolist(), meta.kv_lens.tolist(), meta.block_tables.tolist(),
                                        meta.block_size, device)


def _as_bshd(t: torch.Tensor | None, order: str):
    return t if t is None or order == "bshd" else t.transpose(1, 2)


def _ops_called(calls) -> list[tuple[str, dict]]:
    return [c for c in calls if c[0] in ("npu_fused_infer_attention_score", "single_query_cached_kv_attn",
                                         "flash_attention")]


# -- KV fill -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device,quant_policy,block", CASES)
def test_fill_kv_cache_matches_reference(backend, device, quant_policy, block, dtype):
    be, mode, calls = backend
    order = be.capabilities.kv_axis_order
    caches, k, v, _, everything, _ = _case(order, quant_policy, block, dtype, [1, 1, 1], [37, 20, 3])
    mine = _to_device(caches[order], be.device)
    be.fill_kv_cache(k.to(be.device), v.to(be.device), mine, everything.slot_mapping.to(be.device))
    ops.fill_kv_cache(k, v, caches["bshd"], everything.slot_mapping)
    ref = caches["bshd"]
    for got, want in ((mine.k, ref.k), (mine.v, ref.v), (mine.k_qparams, ref.k_qparams),
                      (mine.v_qparams, ref.v_qparams)):
        if want is not None:  # same scheme, same bytes (codes and (scale, zero))
            assert torch.equal(_as_bshd(got.cpu(), order), want)
    if calls is not None:
        names = {c[0] for c in calls}
        assert names == ({"reshape_paged_cache"} if device == "camb" else {"npu_scatter_nd_update_"})


# -- paged attention -----------------------------------------------------------

# Decode: one new token each. Prefill with history: a decode row, two chunks over cached
# history (one crossing block boundaries) and a fresh prompt.
BATCHES = {
    "decode": ([1, 1, 1, 1], [33, 140, 5, 129]),
    "prefill": ([1, 12, 30, 7], [33, 140, 30, 19]),
}


def _expected_paths(device, quant_policy, block, kind):
    """What the simulation's call log must show for each (device, policy, block, batch kind)."""
    if device == "camb":
        return [("single_query_cached_kv_attn" if kind == "decode" else "flash_attention", {})]
    if kind == "decode":
        if quant_policy == 8:
            return [("npu_fused_infer_attention_score", dict(paged=False, kv_dtype=torch.int8, key_antiquant_mode=3))]
        return [("npu_fused_infer_attention_score", dict(paged=quant_policy == 0, q_s=1))]
    paged = quant_policy == 0 and block % 128 == 0
    return [("npu_fused_infer_attention_score", dict(paged=paged, sparse_mode=3))]


@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device,quant_policy,block", CASES)
def test_paged_attention_matches_reference(backend, device, quant_policy, block, dtype, kind):
    be, mode, calls = backend
    order = be.capabilities.kv_axis_order
    q_lens, kv_lens = BATCHES[kind]
    caches, k, v, q, everything, meta = _case(order, quant_policy, block, dtype, q_lens, kv_lens, seed=1)
    mine = _to_device(caches[order], be.device)
    be.fill_kv_cache(k.to(be.device), v.to(be.device), mine, everything.slot_mapping.to(be.device))
    ops.fill_kv_cache(k, v, caches["bshd"], everything.slot_mapping)
    if calls is not None:
        calls.clear()
    scale = 1 / math.sqrt(D)

    out = be.paged_attention(q.to(be.device), mine, _meta_to(meta, be.device), scale).cpu()
    # The reference reads the same codes (dequantizing them itself) when the cache is quantized.
    want = ops.paged_attention(q, caches["bshd"], meta, scale)
    assert out.shape == want.shape and out.dtype == dtype
    torch.testing.assert_close(out, want, **TOL[dtype])

    if calls is not None:
        got = _ops_called(calls)
        expected = _expected_paths(device, quant_policy, block, kind)
        assert [c[0] for c in got] == [e[0] for e in expected], f"vendor ops called: {got}"
        for (_, info), (_, wanted) in zip(got, expected):
            assert {key: info[key] for key in wanted} == wanted, f"{info} does not show {wanted}"


# -- RMSNorm, rotary, memory ---------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device", VENDORS)
def test_rms_norm_and_rotary_match_reference(backend, device, dtype):
    be, mode, calls = backend
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    torch.testing.assert_close(be.rms_norm(x.to(be.device), w.to(be.device), 1e-6).cpu(),
                               ops.rms_norm(x, w, 1e-6), **TOL[dtype])

    q = torch.randn(7, HQ, D, generator=gen).to(dtype)
    k = torch.randn(7, HKV, D, generator=gen).to(dtype)
    angles = torch.arange(7)[:, None] * torch.rand(D // 2, generator=gen)[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    got = be.apply_rotary(*(t.to(be.device) for t in (q, k, cos, sin)))
    for g, w_ in zip(got, ops.apply_rotary(q, k, cos, sin)):
        torch.testing.assert_close(g.cpu(), w_, **TOL[dtype])
    if calls is not None:
        names = {c[0] for c in calls}
        assert ({"npu_rms_norm", "npu_rotary_mul"} if device == "ascend" else {"fused_rms_norm"}) <= names


@pytest.mark.parametrize("device", VENDORS)
def test_memory_info(backend, device):
    be, _, _ = backend
    free, total = be.memory_info()
    assert isinstance(free, int) and isinstance(total, int) and 0 < free <= total
    be.synchronize()


# -- configuration: the capabilities decide, before any weight loads ---------------

@pytest.mark.parametrize("policy", (4, 8))
def test_camb_refuses_kv_quant_and_ascend_accepts_it(policy):
    with pytest.raises(ConfigError) as info:
        resolve_config(EngineConfig(device_type="camb", quant_policy=policy))
    assert f"quant_policy={policy}" in str(info.value) and "use quant_policy=0" in str(info.value)
    assert "ascend" in str(info.value)  # the message names a device that supports it
    assert resolve_config(EngineConfig(device_type="ascend", quant_policy=policy)).quant_policy == policy


def test_block_size_rules():
    camb = resolve_config(EngineConfig(device_type="camb", block_size=64))
    assert camb.block_size == 16
    assert [(a.field, a.asked, a.used) for a in camb.adjustments] == [("block_size", 64, 16)]
    assert resolve_config(EngineConfig(device_type="ascend")).block_size == 128
    with pytest.raises(ConfigError):
        resolve_config(EngineConfig(device_type="ascend", block_size=48))


# -- the simulations raise where the documented operators do ------------------------

def test_simulated_npu_rejects_what_the_docs_exclude():
    npu = _simulation("ascend")
    q = torch.zeros(1, 4, HQ, D, dtype=torch.float16)
    cache = torch.zeros(4, 16, HKV * D, dtype=torch.float16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    kwargs = dict(num_heads=HQ, num_key_value_heads=HKV, input_layout="BSND", block_table=table, block_size=16,
                  actual_seq_lengths=[4], actual_seq_lengths_kv=[10], sparse_mode=3,
                  atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    with pytest.raises(RuntimeError, match="multiple of 128"):  # page attention with Q_S > 1
        npu.npu_fused_infer_attention_score(q, cache, cache, **kwargs)
    with pytest.raises(RuntimeError, match="contiguous"):
        npu.npu_fused_infer_attention_score(q.transpose(1, 2).contiguous().transpose(1, 2), cache, cache, **kwargs)
    with pytest.raises(TypeError, match="list of ints"):
        npu.npu_fused_infer_attention_score(q, cache, cache, **{**kwargs, "actual_seq_lengths_kv": torch.tensor([10])})
    with pytest.raises(RuntimeError, match="dtype"):  # no uint8 in npu_scatter_nd_update_
        npu.npu_scatter_nd_update_(torch.zeros(4, 2, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.int32),
                                   torch.zeros(1, 2, dtype=torch.uint8))


def test_simulated_mlu_rejects_what_the_docs_exclude():
    tmo = _simulation("camb")
    q = torch.zeros(3, HQ, D, dtype=torch.float16)
    cache = torch.zeros(4, HKV, 32, D, dtype=torch.float16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_size 16"):
        tmo.flash_attention(q, cache, cache, None, cu, cu, None, None, 3, 3, 1.0, True,
                            block_tables=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        new = torch.zeros(1, HKV, D, dtype=torch.float16)
        tmo.reshape_paged_cache(new, new.clone(), cache, cache, torch.zeros(1, dtype=torch.int64))


# -- engine: greedy tokens equal to the cpu backend's -----------------------------

# The third prompt is longer than max_prefill_token_num: prefill in chunks over cached history.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41, 42], [7] * 35]


def _engine_settings(quant_policy: int) -> dict:
    return dict(dtype="float16", quant_policy=quant_policy, cache_max_entry_count=64, max_prefill_token_num=32)


def _greedy(config: EngineConfig, backend=None) -> list[list[int]]:
    from lmport.engine.engine import Engine
    engine = Engine(tiny_model_dir("llama"), config, backend=backend)
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    ids = [engine.add_request(p, gen) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def cpu_tokens():
    """The cpu backend's greedy tokens per quant_policy (block size 16), computed once."""
    made = {}

    def get(quant_policy: int) -> list[list[int]]:
        if quant_policy not in made:
            made[quant_policy] = _greedy(EngineConfig(device_type="cpu", block_size=16,
                                                      **_engine_settings(quant_policy)))
        return made[quant_policy]
    return get


@pytest.mark.parametrize("device,quant_policy,block", [
    pytest.param("ascend", 0, 128, id="ascend-q0-bs128"),
    pytest.param("ascend", 8, 16, id="ascend-q8-bs16"),
    pytest.param("camb", 0, None, id="camb-q0"),
])
def test_engine_greedy_tokens_match_cpu(backend, cpu_tokens, device, quant_policy, block):
    """A tiny random-weight Llama (tests/models.py) in float16, chunked prefill included: same greedy tokens."""
    be, mode, calls = backend
    config = EngineConfig(device_type=device, block_size=block, **_engine_settings(quant_policy))
    assert _greedy(config, be) == cpu_tokens(quant_policy)
    if calls is not None:
        assert _ops_called(calls), "the engine never reached the vendor attention operators"
