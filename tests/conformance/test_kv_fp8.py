"""fp8 KV caches (quant_policy "fp8") and the step's own K/V over every quantized cache, for every installed backend.

The fp8 matrix is each backend whose Capabilities declare the e4m3 format (kv_fp8_formats), read when pytest
collects; ``harness.op_backend`` runs its ops natively, under the Triton interpreter or against a simulated SDK.
What each must show:
- its fill stores the bytes of ``lmport.kv.quant.quantize_fp8`` (torch's own float8 cast of x / scale, clamped to
  +-448), halfway cases, subnormals, saturation and NaN included, with a scale per KV head;
- its paged attention over the fp8 cache equals attention over a cache holding the dequantized values, and stays
  close to attention over the unquantized values.
For every quantized policy a backend declares (INT8, INT4, fp8), attention given the step's own K and V
(``new_kv``) equals an exact dequantize-then-compute: the history dequantized from the backend's own cache, the
step's tokens as computed, attended by the unquantized reference op.
A backend that declares no fp8 format refuses quant_policy "fp8" before anything loads.
"""
from __future__ import annotations

import math

import pytest
import torch

from lmport import ConfigError, EngineConfig, ops
from lmport.kv import quant
from lmport.kv.layout import KVLayout, LayerCache
from lmport.platform import registry
from lmport.platform.resolution import resolve_config

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEADS, HEAD_DIM = 2, 64
SCALES = torch.tensor([1.0, 0.37])   # a scale per KV head: the second not a power of two
# Relative error ||attn(fp8) - attn(unquantized)|| / ||attn(unquantized)|| on N(0, 1) q, K, V, head_dim 64: at
# most 0.031 on the reference over 20 seeds and the three dtypes; the bound leaves about 2x.
FP8_ATTENTION_BOUND = 0.06
EXACT_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _caps(name):
    try:
        return registry.load_backend_class(name).capabilities
    except registry.BackendError:
        return None   # test_capabilities reports backends that fail to load


FP8_BACKENDS = [n for n in registry.backend_names() if (c := _caps(n)) is not None and c.runs_kv_policy("fp8")]
QUANTIZED = [pytest.param(n, p, id=f"{n}-{p}") for n in registry.backend_names() if (c := _caps(n)) is not None
             for p in (8, 4, "fp8") if c.runs_kv_policy(p)]


def _cache(backend, policy, dtype, num_blocks) -> LayerCache:
    caps = backend.capabilities
    block = caps.block_size_forced or max(16, 1 << (caps.block_size_min - 1).bit_length())
    lay = KVLayout(1, HEADS, HEAD_DIM, block, dtype, policy, caps.kv_axis_order)
    cache = lay.allocate(num_blocks, backend.device)[0]
    if quant.is_fp8(policy):
        cache.k_scale.copy_(SCALES)
        cache.v_scale.copy_(SCALES.flip(0))
    return cache


def _bytes(cache_values: torch.Tensor) -> torch.Tensor:
    return cache_values.view(torch.uint8).cpu()


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite e4m3 value, the points halfway between neighbours (ties to even), just off them, past 448
    (saturated), subnormal ones, signed zeros and NaN, as ``dtype`` rows of HEAD_DIM, before the scale."""
    codes = torch.arange(256, dtype=torch.uint8).view(quant.FP8_DTYPE).float()
    finite = codes[~codes.isnan()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    extra = torch.tensor([500.0, -1e4, 449.0, 464.0, 2.0 ** -10, -(2.0 ** -10), 3 * 2.0 ** -11, 0.0, -0.0, math.nan])
    x = torch.cat([finite, mids, mids * (1 + 2 ** -10), mids * (1 - 2 ** -10), extra]).to(dtype)
    pad = -x.numel() % (HEADS * HEAD_DIM)
    return torch.cat([x, torch.zeros(pad, dtype=dtype)]).view(-1, HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", FP8_BACKENDS)
def test_fp8_fill_stores_the_reference_bytes(backends, name, dtype):
    backend, _ = backends(name)
    x = _edge_values(dtype) * SCALES.to(dtype)[:, None]   # each head's values at its own scale
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    block = _cache(backend, "fp8", dtype, 1).block_size
    cache = _cache(backend, "fp8", dtype, -(-x.shape[0] // block))
    slots = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(4))
    backend.fill_kv_cache(x.to(backend.device), v.to(backend.device), cache, slots.to(backend.device))
    flat = x.shape[0], HEADS, HEAD_DIM
    got_k, got_v = _bytes(cache.k).view(-1, HEADS, HEAD_DIM)[slots], _bytes(cache.v).view(-1, HEADS, HEAD_DIM)[slots]
    assert got_k.shape == flat
    _assert_same_bytes(got_k, x, SCALES)
    _assert_same_bytes(got_v, v, SCALES.flip(0))


def _assert_same_bytes(got: torch.Tensor, x: torch.Tensor, scales: torch.Tensor):
    """``got`` holds quantize_fp8(x, scales)'s bytes; otherwise the first differing inputs are named."""
    want = quant.quantize_fp8(x, scales).view(torch.uint8)
    bad = (got != want).nonzero().tolist()
    assert not bad, f"{len(bad)} of {want.numel()} bytes differ: " + "; ".join(
        f"x={x[t, h, d].item()!r} (head {h}) got {int(got[t, h, d]):#04x} want {int(want[t, h, d]):#04x}"
        for t, h, d in bad[:8])


def test_fp8_round_trip_bound():
    """x' = e4m3(x / s) * s is within 2**-4 of |x| (half of e4m3's 3-bit mantissa step) for x / s in the normal range,
    within 2**-10 * s below it, and saturates to +-448 * s beyond it."""
    x = torch.randn(4096, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5)) * 40
    back = quant.dequantize_fp8(quant.quantize_fp8(x, SCALES), SCALES, torch.float32)
    s = SCALES[:, None]
    y = x / s
    normal = (y.abs() >= 2 ** -6) & (y.abs() <= 448)
    err = (back - x).abs()
    assert (err[normal] <= (x.abs() * 2 ** -4)[normal]).all()
    assert (err[y.abs() < 2 ** -6] <= (s * 2 ** -10).expand_as(x)[y.abs() < 2 ** -6]).all()
    assert torch.equal(back[y > 448], (448 * s).expand_as(x)[y > 448])


def _attention_case(backend, policy, dtype, gen):
    """A cache filled with a mixed batch's history and new tokens, and the steps that read it: decode, prefill with
    history and a whole prefill together, and a decode-only batch."""
    kv_lens = [50, 37, 70]
    block = _cache(backend, policy, dtype, 1).block_size
    cache = _cache(backend, policy, dtype, sum(-(-n // block) for n in kv_lens) + 1)
    tables, nxt = [], 1   # block 0 stays unused: it pads the tables
    for n in kv_lens:
        tables.append(list(range(nxt, nxt + -(-n // block))))
        nxt += len(tables[-1])
    dev = backend.device
    everything = ops.build_attention_metadata(kv_lens, kv_lens, tables, block, dev)
    k = torch.randn(sum(kv_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    backend.fill_kv_cache(k.to(dev), v.to(dev), cache, everything.slot_mapping)
    metas = [ops.build_attention_metadata(q_lens, kv_lens, tables, block, dev) for q_lens in ([1, 37, 5], [1, 1, 1])]
    return cache, everything, k, v, metas


def _dequantized(cache: LayerCache, dtype) -> LayerCache:
    """An unquantized bshd cache holding what ``cache`` dequantizes to (lmport.kv.quant), on the CPU."""
    def values(x, params, scale):
        if cache.axis_order == "bhsd":
            x = x.transpose(1, 2)
            params = None if params is None else params.transpose(1, 2)
        if quant.is_fp8(cache.quant_policy):
            return quant.dequantize_fp8(x.cpu(), scale.cpu(), dtype).contiguous()
        return quant.dequantize(x.cpu(), params.cpu(), cache.quant_policy, dtype).contiguous()
    return LayerCache(values(cache.k, cache.k_qparams, cache.k_scale), values(cache.v, cache.v_qparams, cache.v_scale),
                      None, None, 0, cache.block_size)


def _cpu_meta(meta):
    return ops.build_attention_metadata(meta.q_lens.tolist(), meta.kv_lens.tolist(), meta.block_tables.tolist(),
                                        meta.block_size)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", FP8_BACKENDS)
def test_paged_attention_over_fp8_cache(backends, name, dtype):
    backend, _ = backends(name)
    gen = torch.Generator().manual_seed(6)
    cache, everything, k, v, metas = _attention_case(backend, "fp8", dtype, gen)
    deq = _dequantized(cache, dtype)
    plain = KVLayout(1, HEADS, HEAD_DIM, cache.block_size, dtype).allocate(cache.k.shape[0], "cpu")[0]
    ops.fill_kv_cache(k, v, plain, everything.slot_mapping.cpu())
    scale = 1 / math.sqrt(HEAD_DIM)
    for meta in metas:
        q = torch.randn(meta.num_tokens, 2 * HEADS, HEAD_DIM, generator=gen).to(dtype)
        out = backend.paged_attention(q.to(backend.device), cache, meta, scale).cpu()
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out, ops.paged_attention(q, deq, _cpu_meta(meta), scale), **EXACT_TOL[dtype])
        ref = ops.paged_attention(q, plain, _cpu_meta(meta), scale).float()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel <= FP8_ATTENTION_BOUND, f"relative error {rel:.4f} > {FP8_ATTENTION_BOUND}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name,policy", QUANTIZED)
def test_step_attends_to_its_own_kv_as_computed(backends, name, policy, dtype):
    """With new_kv, a step's tokens see their own K and V as computed and their history through the cache: the
    same as the unquantized reference over the history dequantized and the step's rows put back as they are."""
    backend, _ = backends(name)
    gen = torch.Generator().manual_seed(7)
    cache, everything, k, v, metas = _attention_case(backend, policy, dtype, gen)
    scale = 1 / math.sqrt(HEAD_DIM)
    for meta in metas:
        if name == "ascend" and policy == 8 and meta.is_decode:
            continue   # its INT8 decode runs the vendor's antiquant over every code, the new token's too (documented)
        cpu_meta = _cpu_meta(meta)
        # The step's rows: k, v were filled in sequence order, so the step's tokens are each sequence's last ones.
        ends = torch.cumsum(cpu_meta.kv_lens, 0)
        rows = torch.cat([torch.arange(e - n, e) for e, n in zip(ends.tolist(), cpu_meta.q_lens.tolist())])
        new_k, new_v = k[rows], v[rows]
        expected_cache = _dequantized(cache, dtype)
        ops.fill_kv_cache(new_k, new_v, expected_cache, cpu_meta.slot_mapping)   # the step's rows as they are
        q = torch.randn(meta.num_tokens, 2 * HEADS, HEAD_DIM, generator=gen).to(dtype)
        dev = backend.device
        out = backend.paged_attention(q.to(dev), cache, meta, scale, new_kv=(new_k.to(dev), new_v.to(dev))).cpu()
        expected = ops.paged_attention(q, expected_cache, cpu_meta, scale)
        torch.testing.assert_close(out, expected, **EXACT_TOL[dtype])


def test_reference_step_attention_is_exact():
    """The reference op itself, bit for bit: its result is that of attention over the dequantized history with the
    step's own rows as computed."""
    backend = registry.load_backend_class("cpu")()
    gen = torch.Generator().manual_seed(8)
    for policy in (8, 4, "fp8"):
        cache, _, k, v, metas = _attention_case(backend, policy, torch.bfloat16, gen)
        meta = metas[0]
        ends = torch.cumsum(meta.kv_lens, 0)
        rows = torch.cat([torch.arange(e - n, e) for e, n in zip(ends.tolist(), meta.q_lens.tolist())])
        expected_cache = _dequantized(cache, torch.bfloat16)
        ops.fill_kv_cache(k[rows], v[rows], expected_cache, meta.slot_mapping)
        q = torch.randn(meta.num_tokens, 2 * HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        got = ops.paged_attention(q, cache, meta, 0.125, new_kv=(k[rows], v[rows]))
        assert torch.equal(got, ops.paged_attention(q, expected_cache, meta, 0.125)), policy
        # and without new_kv, the step's rows come from the cache
        assert torch.equal(ops.paged_attention(q, cache, meta, 0.125),
                           ops.paged_attention(q, _dequantized(cache, torch.bfloat16), meta, 0.125)), policy


# -- engine-level configuration: fp8 accepted or refused per backend ---------------------------------------------

def test_engine_config_fp8(backend_name, capabilities):
    if capabilities.runs_kv_policy("fp8"):
        for asked in (dict(quant_policy="fp8"), dict(quant_policy="fp8_e4m3"), dict(kv_cache_dtype="fp8"),
                      dict(kv_cache_dtype="fp8_e4m3")):
            resolved = resolve_config(EngineConfig(device_type=backend_name, **asked))
            assert resolved.quant_policy == "fp8"
        lay = KVLayout(1, HEADS, HEAD_DIM, resolved.block_size, getattr(torch, resolved.dtype), "fp8",
                       capabilities.kv_axis_order)
        assert lay.value_dtype == torch.float8_e4m3fn and lay.param_dtype is None
        return
    with pytest.raises(ConfigError) as info:
        resolve_config(EngineConfig(device_type=backend_name, kv_cache_dtype="fp8"))
    message = str(info.value)
    # the capability, this device, the devices that have it, and what to use instead
    assert "quant_policy='fp8'" in message and "kv_fp8_formats" in message and repr(backend_name) in message
    runs = [n for n in registry.backend_names() if (c := _caps(n)) is not None and c.runs_kv_policy("fp8")]
    assert f"fp8 KV caches run on {', '.join(runs) or 'no installed device'}" in message
    assert ("use quant_policy=8 (INT8" if 8 in capabilities.kv_quant_policies else "use quant_policy=0") in message


@pytest.mark.parametrize("name", ["ascend", "camb", "example"])
def test_vendor_and_example_backends_refuse_fp8(name):
    if name not in registry.backend_names():
        pytest.skip(f"{name} is not installed")
    assert not registry.load_backend_class(name).capabilities.kv_fp8_formats
    with pytest.raises(ConfigError, match="declare no fp8 KV format"):
        resolve_config(EngineConfig(device_type=name, quant_policy="fp8"))
