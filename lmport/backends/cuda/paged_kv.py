"""Triton helper: one tile of K or V gathered from the paged cache, dequantized inline.

Shared by the decode and prefill attention kernels. Tokens are gathered one by
one through the block table, so a tile may span several cache blocks and any
block size works. A quantized tile is turned back into the attention dtype
with the reference formula ``((q - zero) * scale).to(dtype)`` (lmport.kv.quant),
so the kernels see the very values the reference attends to. An fp8 tile (QUANT 1,
launch.QUANT_FP8) is read as bytes and decoded with integer and fp32 arithmetic, exactly,
then ``(value * scale).to(dtype)`` with its head's scale: no fp8 hardware is involved.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(cache_ptr, qp_ptr, block_ids, slots, offs_d, mask_n, mask_d,
                 stride_b, stride_s, stride_d, qp_stride_b, qp_stride_s, qp_stride_2,
                 QUANT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    # OUT_DTYPE is the attention (q) dtype, as in the reference; callers widen it for tl.dot if needed.
    """[BLOCK_N, BLOCK_D] tile of token rows ``(block_ids[n], slots[n])``.

    ``cache_ptr``/``qp_ptr`` already point at the KV head. Masked entries are 0.
    """
    rows = block_ids.to(tl.int64) * stride_b + slots * stride_s
    mask = mask_n[:, None] & mask_d[None, :]
    if QUANT == 0:
        x = tl.load(cache_ptr + rows[:, None] + offs_d[None, :] * stride_d, mask=mask, other=0.0)
        out = x.to(OUT_DTYPE)
    elif QUANT == 1:
        raw = tl.load(cache_ptr + rows[:, None] + offs_d[None, :] * stride_d, mask=mask, other=0).to(tl.int32)
        scale, _ = load_qparams(qp_ptr, block_ids, slots, mask_n, qp_stride_b, qp_stride_s, qp_stride_2)
        out = (decode_e4m3(raw) * scale[:, None]).to(OUT_DTYPE)
    else:
        if QUANT == 4:
            # Two values a byte: element 2i in the low nibble, 2i + 1 in the high one. Each byte is loaded
            # once, the row's bytes side by side (reading every byte twice, at offs_d // 2, defeats vector
            # loads), and the nibbles are interleaved back into element order. (Interleaving the two
            # halves after dequantizing them instead fails Triton's NVIDIA lowering in the prefill kernel.)
            offs_b, _ = tl.split(tl.reshape(offs_d // 2, (offs_d.shape[0] // 2, 2)))
            mask_b, _ = tl.split(tl.reshape(mask_d, (offs_d.shape[0] // 2, 2)))
            raw = tl.load(cache_ptr + rows[:, None] + offs_b[None, :] * stride_d,
                          mask=mask_n[:, None] & mask_b[None, :], other=0).to(tl.int32)
            raw = tl.interleave(raw & 0xF, raw >> 4)
        else:
            raw = tl.load(cache_ptr + rows[:, None] + offs_d[None, :] * stride_d, mask=mask, other=0)
            raw = raw.to(tl.int32)
        scale, zero = load_qparams(qp_ptr, block_ids, slots, mask_n, qp_stride_b, qp_stride_s, qp_stride_2)
        out = ((raw.to(tl.float32) - zero[:, None]) * scale[:, None]).to(OUT_DTYPE)
    return out


@triton.jit
def decode_e4m3(raw):
    """float32 values of float8 e4m3fn bytes (int32 0..255), exactly as torch casts them: sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2**-9), 0x7f / 0xff are NaN."""
    mag = raw & 0x7F
    exp = mag >> 3
    # A normal's bits as a float32: the exponent rebiased (127 - 7 = 120), the mantissa at the top of float32's.
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(exp == 0, (mag & 7).to(tl.float32) * 0.001953125, normal)
    value = tl.where(mag == 0x7F, float("nan"), value)
    return tl.where(raw >= 0x80, -value, value)


@triton.jit
def load_qparams(qp_ptr, block_ids, slots, mask_n, qp_stride_b, qp_stride_s, qp_stride_2):
    """(scale, zero) in float32 of the token rows ``(block_ids[n], slots[n])``; 0 where masked."""
    qp_rows = block_ids.to(tl.int64) * qp_stride_b + slots * qp_stride_s
    scale = tl.load(qp_ptr + qp_rows, mask=mask_n, other=0.0).to(tl.float32)
    zero = tl.load(qp_ptr + qp_rows + qp_stride_2, mask=mask_n, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def load_int4_halves(cache_ptr, qp_ptr, block_ids, slots, offs_b, mask_n, mask_b,
                     stride_b, stride_s, stride_d, qp_stride_b, qp_stride_s, qp_stride_2, OUT_DTYPE: tl.constexpr):
    """An INT4 tile as its even and its odd elements ([BLOCK_N, len(offs_b)] each, dequantized): byte i holds
    element 2i in its low nibble and 2i + 1 in its high one, so a kernel that keeps the halves apart (a
    product whose other side it splits the same way) never interleaves them."""
    rows = block_ids.to(tl.int64) * stride_b + slots * stride_s
    raw = tl.load(cache_ptr + rows[:, None] + offs_b[None, :] * stride_d,
                  mask=mask_n[:, None] & mask_b[None, :], other=0).to(tl.int32)
    scale, zero = load_qparams(qp_ptr, block_ids, slots, mask_n, qp_stride_b, qp_stride_s, qp_stride_2)
    even = (((raw & 0xF).to(tl.float32) - zero[:, None]) * scale[:, None]).to(OUT_DTYPE)
    odd = (((raw >> 4).to(tl.float32) - zero[:, None]) * scale[:, None]).to(OUT_DTYPE)
    return even, odd
