"""KV-cache quantization (quant_policy 8 and 4) for every installed backend that declares it.

The matrix is (backend, policy) for each policy in the backend's
Capabilities.kv_quant_policies, read when pytest collects, so a backend joins
as soon as it declares the policy; ``harness.op_backend`` decides how its ops
run here (native, Triton interpreter, simulated vendor SDK) or skips it.

What every such backend must show (docs/kv-quantization.md has the scheme):
- its fill_kv_cache stores what ``lmport.kv.quant.quantize`` gives, up to one
  level, and the nibble order of INT4 is the documented one;
- every stored element dequantizes within scale/2 of the input, for the edge
  vectors too, and nothing is NaN or Inf (saturating beyond the param range);
- paged attention over the quantized cache equals the reference attention over
  a cache holding the dequantized values, and stays within a measured bound of
  attention over the unquantized values.
"""
from __future__ import annotations

import math

import pytest
import torch

from lmport import ConfigError, EngineConfig, ops

from lmport.platform import registry
from lmport.kv import quant
from lmport.kv.layout import KVLayout, LayerCache
from lmport.platform.resolution import resolve_config

POLICIES = (8, 4)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEADS, HEAD_DIM = 2, 64

# Largest magnitudes for which scale/2 is guaranteed: fp16 and fp32 near their own range
# (fp32 leaves room for max - min); bf16 as far as its fp16 scale reaches with INT4's 15 levels.
LARGE = {torch.float16: 6e4, torch.bfloat16: 3e5, torch.float32: 1e30}
SMALL = {torch.float16: 1e-6, torch.bfloat16: 1e-30, torch.float32: 1e-30}

# Relative error ||attn(quantized) - attn(unquantized)|| / ||attn(unquantized)|| on N(0,1) q, K, V,
# head_dim 64. Measured on the reference (20 seeds, fp32/fp16/bf16): INT8 at most 0.0079, INT4 at
# most 0.120. The bounds leave about 2x and 1.7x of room.
ATTENTION_BOUND = {8: 0.015, 4: 0.2}
# Float tolerance of "equals attention over the dequantized values" (kernels may sum in another order).
EXACT_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _matrix() -> list:
    params = []
    for name in registry.backend_names():
        try:
            caps = registry.load_backend_class(name).capabilities
        except registry.BackendError:
            continue  # test_capabilities reports backends that fail to load
        params += [pytest.param(name, p, id=f"{name}-int{p}") for p in POLICIES if p in caps.kv_quant_policies]
    return params


MATRIX = _matrix()


def _block_size(caps) -> int:
    if caps.block_size_forced is not None:
        return caps.block_size_forced
    return max(16, 1 << (caps.block_size_min - 1).bit_length())  # a power of two that every rule accepts


def _cache(backend, policy, dtype, num_blocks) -> tuple[LayerCache, int]:
    caps = backend.capabilities
    block = _block_size(caps)
    lay = KVLayout(1, HEADS, HEAD_DIM, block, dtype, policy, caps.kv_axis_order)
    return lay.allocate(num_blocks, backend.device)[0], block


def _slots(t: torch.Tensor, order: str) -> torch.Tensor:
    """[blocks, ...] cache tensor in ``order`` -> [slots, heads, last] (block-major, slot order)."""
    if order == "bhsd":
        t = t.transpose(1, 2)
    return t.reshape(-1, *t.shape[2:])


def _unpack(q: torch.Tensor, policy: int) -> torch.Tensor:
    """Stored bytes -> one level per element (INT4: low nibble = even element)."""
    if policy == 4:
        return torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)
    return q


def _edge_rows(dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Named groups of [n, HEADS, HEAD_DIM] rows; each (token, head) row is quantized on its own."""
    def rand(n, scale=1.0):
        return torch.randn(n, HEADS, HEAD_DIM, generator=gen) * scale

    big, small = LARGE[dtype], SMALL[dtype]
    outlier = rand(4)
    outlier[..., 7] = 1000.0
    return {
        "normal": rand(16),
        "constant": torch.full((2, HEADS, HEAD_DIM), 3.7),
        "negative constant": torch.full((2, HEADS, HEAD_DIM), -1234.5),
        "zeros": torch.zeros(2, HEADS, HEAD_DIM),
        "far from zero, narrow": 100 + torch.rand(4, HEADS, HEAD_DIM, generator=gen),  # zero widening
        "large": (torch.rand(4, HEADS, HEAD_DIM, generator=gen) * 2 - 1) * big,
        "large positive": big * (0.5 + 0.5 * torch.rand(2, HEADS, HEAD_DIM, generator=gen)),
        "small": rand(4, small),
        "outlier channel": outlier,
    }


def _fill(backend, policy, dtype, x, gen):
    """Write x [T, H, D] as both K and V into shuffled slots; return (cache, slots)."""
    n = x.shape[0]
    block = _block_size(backend.capabilities)
    num_blocks = -(-n // block) + 1
    cache, _ = _cache(backend, policy, dtype, num_blocks)
    slots = torch.randperm(num_blocks * block, generator=gen)[:n]
    backend.fill_kv_cache(x.to(backend.device), x.to(backend.device), cache, slots.to(backend.device))
    return cache, slots


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name,policy", MATRIX)
def test_fill_round_trip_within_half_scale(backends, name, policy, dtype):
    backend, _ = backends(name)
    order = backend.capabilities.kv_axis_order
    gen = torch.Generator().manual_seed(policy)
    groups = _edge_rows(dtype, gen)
    x = torch.cat(list(groups.values())).to(dtype)
    assert torch.isfinite(x).all(), "test data must be representable in the dtype"
    cache, slots = _fill(backend, policy, dtype, x, gen)

    for values, params in ((cache.k, cache.k_qparams), (cache.v, cache.v_qparams)):
        q = _slots(values, order).cpu()[slots]
        p = _slots(params, order).cpu()[slots]
        assert p.dtype == quant.param_dtype(dtype)
        assert torch.isfinite(p).all(), "scale/zero must be finite"

        # Same levels and params as the reference quantize, up to one level.
        ref_q, ref_p = quant.quantize(x, policy, p.dtype)
        level_diff = (_unpack(q, policy).int() - _unpack(ref_q, policy).int()).abs()
        assert level_diff.max() <= 1, f"{int((level_diff > 1).sum())} elements differ by more than one level"
        assert (p[..., 1].float() - ref_p[..., 1].float()).abs().max() <= 1, "zero point differs"
        scale, ref_scale = p[..., 0].float(), ref_p[..., 0].float()
        assert ((scale - ref_scale).abs() <= ref_scale * 2.0 ** -9).all(), "scale differs from the reference"

        # The bound, with the backend's own stored scale: |x - x'| <= scale / 2 per element.
        # (fp32 work on |x / scale| < 2^12 adds at most ~2^-11 of a level.)
        deq = quant.dequantize(q, p, policy, torch.float32)
        assert torch.isfinite(deq).all()
        err = (deq - x.float()).abs() / p[..., 0:1].float()
        start = 0
        for group, rows in groups.items():
            worst = err[start:start + rows.shape[0]].max().item()
            assert worst <= 0.5 + 2.0 ** -10, f"{group}: max error {worst:.4f} x scale > scale/2"
            start += rows.shape[0]
        # Dequantized in the cache dtype (what attention reads): finite, and only the cast's rounding added.
        deq_dtype = quant.dequantize(q, p, policy, dtype)
        assert torch.isfinite(deq_dtype).all()
        torch.testing.assert_close(deq_dtype.float(), deq.to(dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype,magnitude", [(torch.bfloat16, 1e30), (torch.bfloat16, 1e7),
                                             (torch.float32, 3e38)], ids=["bf16-1e30", "bf16-1e7", "fp32-3e38"])
@pytest.mark.parametrize("name,policy", MATRIX)
def test_beyond_param_range_saturates_finite(backends, name, policy, dtype, magnitude):
    """A range wider than the param dtype can scale (bf16 with fp16 params; fp32 near its max):
    values saturate, and nothing stored or dequantized is NaN or Inf."""
    backend, _ = backends(name)
    order = backend.capabilities.kv_axis_order
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([(torch.rand(3, HEADS, HEAD_DIM, generator=gen) * 2 - 1) * magnitude,
                   torch.full((1, HEADS, HEAD_DIM), magnitude)]).to(dtype)
    assert torch.isfinite(x).all()
    cache, slots = _fill(backend, policy, dtype, x, gen)
    q = _slots(cache.k, order).cpu()[slots]
    p = _slots(cache.k_qparams, order).cpu()[slots]
    assert torch.isfinite(p).all()
    assert torch.isfinite(quant.dequantize(q, p, policy, dtype)).all()
    assert torch.isfinite(quant.dequantize(q, p, policy, torch.float32)).all()


@pytest.mark.parametrize("name", [p.values[0] for p in MATRIX if p.values[1] == 4])
def test_int4_nibble_order(backends, name):
    """Element 2i in the low nibble, 2i + 1 in the high one: identical on every backend."""
    backend, _ = backends(name)
    order = backend.capabilities.kv_axis_order
    # Row 0..15 repeated: min 0, max 15, so the scale is ~1 and the levels are the values.
    x = torch.arange(HEAD_DIM, dtype=torch.float32).remainder(16).expand(1, HEADS, HEAD_DIM).contiguous()
    cache, _ = _cache(backend, 4, torch.float32, 1)
    backend.fill_kv_cache(x.to(backend.device), x.to(backend.device), cache,
                          torch.tensor([0], device=backend.device))
    stored = _slots(cache.k, order).cpu()[0]
    expected = torch.tensor([(2 * i % 16) | ((2 * i + 1) % 16) << 4 for i in range(HEAD_DIM // 2)],
                            dtype=torch.uint8)
    assert stored.tolist() == [expected.tolist()] * HEADS


def _attention_case(backend, policy, dtype, gen):
    """A mixed batch (decode, prefill with history, full prefill) and a decode-only batch."""
    caps = backend.capabilities
    dev = backend.device
    kv_lens = [50, 37, 70]
    cache, block = _cache(backend, policy, dtype, sum(-(-n // _block_size(caps)) for n in kv_lens) + 1)
    tables, nxt = [], 1  # block 0 stays unused: it pads the tables
    for n in kv_lens:
        tables.append(list(range(nxt, nxt + -(-n // block))))
        nxt += len(tables[-1])
    everything = ops.build_attention_metadata(kv_lens, kv_lens, tables, block, dev)
    k = torch.randn(sum(kv_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    metas = [ops.build_attention_metadata(q_lens, kv_lens, tables, block, dev)
             for q_lens in ([1, 37, 5], [1, 1, 1])]
    return cache, everything, k, v, metas


def _reference_cache(k, v, meta, dtype, block, num_blocks):
    lay = KVLayout(1, HEADS, HEAD_DIM, block, dtype, 0)
    cache = lay.allocate(num_blocks, "cpu")[0]
    ops.fill_kv_cache(k, v, cache, meta.slot_mapping.cpu())
    return cache


def _meta_cpu(meta):
    return ops.build_attention_metadata(meta.q_lens.tolist(), meta.kv_lens.tolist(),
                                        meta.block_tables.tolist(), meta.block_size)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name,policy", MATRIX)
def test_paged_attention_over_quantized_cache(backends, name, policy, dtype):
    backend, _ = backends(name)
    order = backend.capabilities.kv_axis_order
    gen = torch.Generator().manual_seed(100 + policy)
    cache, everything, k, v, metas = _attention_case(backend, policy, dtype, gen)
    dev = backend.device
    backend.fill_kv_cache(k.to(dev), v.to(dev), cache, everything.slot_mapping)
    num_blocks, block = cache.k.shape[0], cache.block_size

    # A 16-bit/fp32 reference cache holding the values the quantized one dequantizes to.
    def dequantized(values, params):
        d = quant.dequantize(_slots(values, order).cpu(), _slots(params, order).cpu(), policy, dtype)
        return d.view(num_blocks, block, HEADS, HEAD_DIM)
    deq = LayerCache(dequantized(cache.k, cache.k_qparams), dequantized(cache.v, cache.v_qparams),
                     None, None, 0, block)
    plain = _reference_cache(k, v, everything, dtype, block, num_blocks)
    scale = 1 / math.sqrt(HEAD_DIM)

    for meta in metas:
        q = torch.randn(meta.num_tokens, 2 * HEADS, HEAD_DIM, generator=gen).to(dtype)  # GQA, 2 q heads a KV head
        out = backend.paged_attention(q.to(dev), cache, meta, scale).cpu()
        assert out.dtype == dtype and torch.isfinite(out).all()
        cpu_meta = _meta_cpu(meta)
        # Equal to attention over the dequantized values, within float tolerance.
        torch.testing.assert_close(out, ops.paged_attention(q, deq, cpu_meta, scale), **EXACT_TOL[dtype])
        # Close to attention over the unquantized values, within the measured bound.
        ref = ops.paged_attention(q, plain, cpu_meta, scale).float()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel <= ATTENTION_BOUND[policy], f"relative error {rel:.4f} > {ATTENTION_BOUND[policy]}"


# -- engine-level configuration: quant_policy accepted or rejected per backend ------------

@pytest.mark.parametrize("policy", (0, 8, 4))
def test_engine_config_quant_policy(backend_name, capabilities, policy):
    if policy in capabilities.kv_quant_policies:
        resolved = resolve_config(EngineConfig(device_type=backend_name, quant_policy=policy))
        assert resolved.quant_policy == policy
        # The resolved config gives the cache layout its policy (uint8 values when quantized).
        lay = KVLayout(1, HEADS, HEAD_DIM, resolved.block_size, getattr(torch, resolved.dtype), policy,
                       capabilities.kv_axis_order)
        assert lay.value_dtype == (torch.uint8 if policy else getattr(torch, resolved.dtype))
        return
    with pytest.raises(ConfigError) as info:
        resolve_config(EngineConfig(device_type=backend_name, quant_policy=policy))
    message = str(info.value)
    assert f"quant_policy={policy}" in message and backend_name in message
    assert "use quant_policy=0" in message
