"""KV cache fill through the slot mapping, quantizing to INT8/INT4 in the same pass.

Matches ``lmport.ops.fill_kv_cache``. A program takes ROWS (token, KV head)
rows, K and V: each row is read once, quantized in registers and written once.
The quantization repeats ``lmport.kv.quant.quantize`` step by step in fp32:
IEEE divisions (``div_rn``), the scale rounded to the param dtype the same
way, and round-half-to-even like ``torch.round``, so values and params come
out bit-identical to the reference (tests allow one quantization level of
difference for a GPU whose arithmetic might still differ).
An fp8 cache (QUANT 1, launch.QUANT_FP8) is written as bytes: ``x / scale`` (its head's scale),
clamped to +-448 and rounded to float8 e4m3 with integer arithmetic, round to nearest even as
torch's cast does, so the bytes are the reference's on any GPU, fp8 hardware or not.
A negative slot (a padded row, e.g. in a CUDA-graph batch) is skipped.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import INTERPRETED, cache_values, kernel_quant, pow2, qparam_args, tl_dtype
from lmport.backends.cuda.reductions import MAX, MIN
from lmport.kv import quant
from lmport.kv.layout import LayerCache


@triton.jit
def _round_half_even(x):
    # torch.round rounds halves to even; floor-based so it runs the same everywhere.
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _params(lo, hi, valid, LEVELS: tl.constexpr, EPS: tl.constexpr, ZERO_LIMIT: tl.constexpr,
            PMAX: tl.constexpr, PDTYPE: tl.constexpr):
    """(scale, zero) in fp32 from each row's min and max, as quant.quantize."""
    # Rows that are not written (padding, slot < 0) saw no values: keep them finite.
    lo = tl.where(valid, lo, 0.0)
    hi = tl.where(valid, hi, 0.0)
    scale = tl.maximum(tl.math.div_rn(tl.maximum(hi - lo, EPS), LEVELS),
                       tl.math.div_rn(tl.abs(lo), ZERO_LIMIT))
    # Round the stored scale up (x (1 + 2**-9)) as the reference does, clamped to the param
    # dtype's largest finite value (values then saturate), and use the stored value from here on.
    scale = tl.minimum(scale * 1.001953125, PMAX).to(PDTYPE).to(tl.float32)
    zero = _round_half_even(tl.math.div_rn(-lo, scale))
    zero = tl.minimum(tl.maximum(zero, -ZERO_LIMIT), ZERO_LIMIT)
    return scale, zero


@triton.jit
def _levels(x, scale, zero, LEVELS: tl.constexpr):
    q = _round_half_even(tl.math.div_rn(x, scale[:, None])) + zero[:, None]
    return tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.uint8)


@triton.jit
def encode_e4m3(y):
    """float8 e4m3fn bytes (int32) of float32 ``y`` already within +-448, as torch's cast rounds them (to nearest,
    ties to even); NaN stays NaN (0x7f, with its sign)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = tl.abs(y)
    # Below 2**-6 (subnormal in e4m3): adding 2**14 rounds |y| to a multiple of 2**-9 in float32's own rounding (to
    # nearest even), and the low bits of the sum are that multiple.
    sub = (mag + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    # Normal: float32's 23 mantissa bits rounded to 3 (ties to even), the exponent rebiased from 127 to 7.
    m = mag.to(tl.int32, bitcast=True)
    normal = (m + ((7 - 127) << 23) + 0x7FFFF + ((m >> 20) & 1)) >> 20
    code = tl.where(mag < 0.015625, sub, normal)
    code = tl.where(y != y, 0x7F, code)
    return code | sign


@triton.jit
def _fill(src, s_t, s_h, s_d, dst, qp, tok, head, slot_block, slot_off, valid,
          c_b, c_s, c_h, c_d, p_b, p_s, p_h, p_2,
          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, LEVELS: tl.constexpr,
          EPS: tl.constexpr, ZERO_LIMIT: tl.constexpr, PMAX: tl.constexpr, PDTYPE: tl.constexpr):
    """Write [ROWS, HEAD_DIM] rows of K or V into their cache slots.

    BLOCK_D covers the stored columns: HEAD_DIM, or HEAD_DIM // 2 bytes for INT4.
    """
    offs_d = tl.arange(0, BLOCK_D)
    row = src + (tok * s_t + head * s_h)[:, None]
    out = dst + (slot_block * c_b + slot_off * c_s + head * c_h)[:, None] + offs_d[None, :] * c_d
    if QUANT == 0:
        mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
        x = tl.load(row + offs_d[None, :] * s_d, mask=mask)
        tl.store(out, x.to(dst.dtype.element_ty), mask=mask)
    elif QUANT == 1:   # launch.QUANT_FP8
        mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
        x = tl.load(row + offs_d[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(qp + head * p_h, mask=valid, other=1.0)   # the head's scale (params strides 0 but p_h)
        # A NaN stays the input's, sign included, as torch's division keeps it (a GPU's gives its canonical NaN).
        y = tl.where(x != x, x, tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0))
        tl.store(out, encode_e4m3(y).to(tl.uint8), mask=mask)
    else:
        inf = float("inf")
        if QUANT == 4:
            # Byte i holds element 2i in the low nibble and 2i + 1 in the high one.
            mask = valid[:, None] & (offs_d < HEAD_DIM // 2)[None, :]
            even = tl.load(row + (2 * offs_d)[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
            odd = tl.load(row + (2 * offs_d + 1)[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
            lo = tl.reduce(tl.minimum(tl.where(mask, even, inf), tl.where(mask, odd, inf)), 1, MIN)
            hi = tl.reduce(tl.maximum(tl.where(mask, even, -inf), tl.where(mask, odd, -inf)), 1, MAX)
            scale, zero = _params(lo, hi, valid, LEVELS, EPS, ZERO_LIMIT, PMAX, PDTYPE)
            packed = _levels(even, scale, zero, LEVELS) | (_levels(odd, scale, zero, LEVELS) << 4)
        else:
            mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
            x = tl.load(row + offs_d[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
            lo = tl.reduce(tl.where(mask, x, inf), 1, MIN)
            hi = tl.reduce(tl.where(mask, x, -inf), 1, MAX)
            scale, zero = _params(lo, hi, valid, LEVELS, EPS, ZERO_LIMIT, PMAX, PDTYPE)
            packed = _levels(x, scale, zero, LEVELS)
        tl.store(out, packed, mask=mask)
        params = qp + slot_block * p_b + slot_off * p_s + head * p_h
        tl.store(params, scale.to(PDTYPE), mask=valid)
        tl.store(params + p_2, zero.to(PDTYPE), mask=valid)


@triton.jit
def _fill_kernel(k, v, k_cache, v_cache, k_qp, v_qp, slot_mapping, num_rows,
                 sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,
                 c_b, c_s, c_h, c_d, p_b, p_s, p_h, p_2,
                 PAGE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                 LEVELS: tl.constexpr, EPS: tl.constexpr, ZERO_LIMIT: tl.constexpr, PMAX: tl.constexpr,
                 PDTYPE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)   # row = token * NUM_HEADS + head
    tok = r // NUM_HEADS
    head = r % NUM_HEADS
    slot = tl.load(slot_mapping + tok, mask=r < num_rows, other=-1).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    slot_block = slot // PAGE
    slot_off = slot % PAGE
    _fill(k, sk_t, sk_h, sk_d, k_cache, k_qp, tok, head, slot_block, slot_off, valid,
          c_b, c_s, c_h, c_d, p_b, p_s, p_h, p_2,
          HEAD_DIM, BLOCK_D, QUANT, LEVELS, EPS, ZERO_LIMIT, PMAX, PDTYPE)
    _fill(v, sv_t, sv_h, sv_d, v_cache, v_qp, tok, head, slot_block, slot_off, valid,
          c_b, c_s, c_h, c_d, p_b, p_s, p_h, p_2,
          HEAD_DIM, BLOCK_D, QUANT, LEVELS, EPS, ZERO_LIMIT, PMAX, PDTYPE)


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; writes token t into slot ``slot_mapping[t]`` (skipped when negative)."""
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    policy = kernel_quant(cache)
    qp_k, qp_v, p_strides = qparam_args(cache)
    codes = policy in (4, 8)
    pdtype = qp_k.dtype if codes else torch.float32
    eps = torch.finfo(pdtype).tiny * ((1 << policy) - 1) if codes else 0.0
    block_d = pow2(quant.packed_dim(head_dim, policy))
    k_cache, v_cache = cache_values(cache)
    # ~2K elements a program on a GPU; the interpreter runs programs one by one, so fewer, larger ones.
    rows = 64 if INTERPRETED else max(1, min(64, 2048 // block_d))
    num_rows = tokens * heads
    # fp32 max - min may overflow to inf, exactly as in the reference; numpy (interpreter) would warn.
    with np.errstate(over="ignore") if INTERPRETED else contextlib.nullcontext():
        _fill_kernel[(triton.cdiv(num_rows, rows),)](
            k, v, k_cache, v_cache, qp_k, qp_v, slot_mapping, num_rows,
            *k.stride(), *v.stride(), *cache.k.stride(), *p_strides,
            PAGE=cache.block_size, NUM_HEADS=heads, HEAD_DIM=head_dim,
            ROWS=rows, BLOCK_D=block_d, QUANT=policy, LEVELS=float((1 << policy) - 1) if codes else 0.0,
            EPS=eps, ZERO_LIMIT=float(quant.ZERO_LIMIT), PMAX=torch.finfo(pdtype).max, PDTYPE=tl_dtype(pdtype),
            num_warps=4,
        )
