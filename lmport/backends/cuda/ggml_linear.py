"""x @ W^T (+ bias) with W held in its GGUF blocks (lmport.weights.ggml.GGMLWeight): Q4_K, Q6_K and friends.

One GEMM loop for every type. A program computes a BLOCK_M x BLOCK_N tile of y and walks the
inputs a block at a time; within a block, one run of 32 inputs at a time (``tl.static_range``,
so the block's header loads are shared by its runs): the type's dequantize helper reads the run's
bytes of the BLOCK_N weight rows straight from the blocks as the file stores them and returns the
[BLOCK_N, 32] weights in fp32, computed as ``gguf.quants`` (llama.cpp's dequantize_row_*)
computes them; they are cast to x's dtype (as the reference dequantizes to it) and multiplied with
x by ``tl.dot`` into an fp32 accumulator. The weight is read once per BLOCK_M rows of x.

Every helper takes ``blk`` ([BLOCK_N, 1] pointers to the first byte of each row's current block),
``s`` (the run within the block, a constexpr), ``j`` ([1, 32], the input within the run) and
``lut`` (the IQ4 value table; unused by the others). Input ``i = 32 s + j`` of a block is
the element ``i`` of llama.cpp's dequantized block. Byte layouts: ggml-common.h's ``block_*``.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import INTERPRETED, dot_args, tl_dtype
from lmport.weights.ggml import GGMLWeight

RUN = 32
# IQ4_NL / IQ4_XS: the 16 non-linear levels a 4-bit code indexes (ggml-common.h kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _f16(p):
    """The little-endian float16 at byte p, as fp32."""
    bits = tl.load(p).to(tl.uint16) | (tl.load(p + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(p, j):
    """4-bit code j (0..31) of 16 packed bytes at p: low nibbles hold codes 0..15, high nibbles 16..31."""
    return (_u8(p + j % 16) >> ((j // 16) * 4)) & 15


@triton.jit
def _high_bit(p, i):
    """Bit i of the little-endian bit mask at p (Q5_0 / Q5_1's fifth bits)."""
    return (_u8(p + i // 8) >> (i % 8)) & 1


@triton.jit
def _k_scale_min(sc, s: tl.constexpr):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block s from the 12 packed bytes at sc."""
    if s < 4:
        scale = _u8(sc + s) & 63
        mn = _u8(sc + s + 4) & 63
    else:
        scale = (_u8(sc + s + 4) & 15) | ((_u8(sc + s - 4) >> 2) & 48)
        mn = (_u8(sc + s + 4) >> 4) | ((_u8(sc + s) >> 2) & 48)
    return scale.to(tl.float32), mn.to(tl.float32)


# -- one helper a type: (blk, s, j, lut) -> [BLOCK_N, 32] fp32 weights -------------------------

@triton.jit
def _q5_0(blk, s: tl.constexpr, j, lut):
    # block_q5_0 (22 bytes): d f16 | qh 4 bytes (bit i: fifth bit of code i) | qs 16 bytes; w = d (q - 16)
    q = _nibble(blk + 6, j) | (_high_bit(blk + 2, j) << 4)
    return _f16(blk) * (q - 16).to(tl.float32)


@triton.jit
def _q5_1(blk, s: tl.constexpr, j, lut):
    # block_q5_1 (24 bytes): d f16 | m f16 | qh 4 bytes | qs 16 bytes; w = d q + m
    q = _nibble(blk + 8, j) | (_high_bit(blk + 4, j) << 4)
    return _f16(blk) * q.to(tl.float32) + _f16(blk + 2)


@triton.jit
def _q2_k(blk, s: tl.constexpr, j, lut):
    # block_q2_K (84 bytes): scales 16 bytes (low nibble: scale, high: min, one a 16 inputs) |
    # qs 64 bytes (2-bit codes; run s in bits 2 (s % 4) of bytes 32 (s // 4) + j) | d f16 | dmin f16
    sc = _u8(blk + 2 * s + j // 16)
    q = (_u8(blk + 16 + (s // 4) * 32 + j) >> ((s % 4) * 2)) & 3
    dl = _f16(blk + 80) * (sc & 15).to(tl.float32)
    ml = _f16(blk + 82) * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q3_k(blk, s: tl.constexpr, j, lut):
    # block_q3_K (110 bytes): hmask 32 bytes (run s: bit s of byte j; a clear bit subtracts 4) |
    # qs 64 bytes (low 2 bits, as Q2_K) | scales 12 bytes (16 6-bit scales, offset 32) | d f16
    g = 2 * s + j // 16                                            # the 16-input group's scale
    low = (_u8(blk + 96 + g % 8) >> ((g // 8) * 4)) & 15
    high = (_u8(blk + 104 + g % 4) >> ((g // 4) * 2)) & 3
    scale = ((low | (high << 4)) - 32).to(tl.float32)
    q = ((_u8(blk + 32 + (s // 4) * 32 + j) >> ((s % 4) * 2)) & 3) - (((_u8(blk + j) >> s) & 1) ^ 1) * 4
    return (_f16(blk + 108) * scale) * q.to(tl.float32)


@triton.jit
def _q4_k(blk, s: tl.constexpr, j, lut):
    # block_q4_K (144 bytes): d f16 | dmin f16 | scales 12 bytes (8 6-bit scales and mins) |
    # qs 128 bytes (runs 2t and 2t + 1 in the low and high nibbles of bytes 32 t + j); w = d sc q - dmin m
    scale, mn = _k_scale_min(blk + 4, s)
    q = (_u8(blk + 16 + (s // 2) * 32 + j) >> ((s % 2) * 4)) & 15
    return (_f16(blk) * scale) * q.to(tl.float32) - _f16(blk + 2) * mn


@triton.jit
def _q5_k(blk, s: tl.constexpr, j, lut):
    # block_q5_K (176 bytes): as Q4_K with qh 32 bytes (run s: bit s of byte j, the fifth bit) before qs
    scale, mn = _k_scale_min(blk + 4, s)
    q = ((_u8(blk + 48 + (s // 2) * 32 + j) >> ((s % 2) * 4)) & 15) | (((_u8(blk + 16 + j) >> s) & 1) << 4)
    return (_f16(blk) * scale) * q.to(tl.float32) - _f16(blk + 2) * mn


@triton.jit
def _q6_k(blk, s: tl.constexpr, j, lut):
    # block_q6_K (210 bytes): ql 128 bytes (low 4 bits) | qh 64 bytes (high 2 bits) |
    # scales 16 int8 (one a 16 inputs) | d f16; w = d scale (q - 32). The 256 inputs are two halves
    # of 128 (h = s // 4); in a half, run s % 4 takes nibble (s // 2) % 2 of ql bytes 64 h + 32 (s % 2) + j
    # and bits 2 (s % 4) of qh byte 32 h + j.
    ql = (_u8(blk + (s // 4) * 64 + (s % 2) * 32 + j) >> (((s // 2) % 2) * 4)) & 15
    qh = (_u8(blk + 128 + (s // 4) * 32 + j) >> ((s % 4) * 2)) & 3
    scale = tl.load(blk + 192 + 2 * s + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
    return (_f16(blk + 208) * scale) * ((ql | (qh << 4)) - 32).to(tl.float32)


@triton.jit
def _iq4_nl(blk, s: tl.constexpr, j, lut):
    # block_iq4_nl (18 bytes): d f16 | qs 16 bytes (as Q4_0); w = d IQ4_VALUES[q]
    return _f16(blk) * tl.load(lut + _nibble(blk + 2, j))


@triton.jit
def _iq4_xs(blk, s: tl.constexpr, j, lut):
    # block_iq4_xs (136 bytes): d f16 | scales_h u16 (2 bits a run) | scales_l 4 bytes (a nibble a run) |
    # qs 128 bytes (run s: 16 bytes at 16 s, as IQ4_NL); w = d (scale - 32) IQ4_VALUES[q]
    low = (_u8(blk + 4 + s // 2) >> ((s % 2) * 4)) & 15
    high = (_u8(blk + 2 + s // 4) >> ((s % 4) * 2)) & 3
    scale = ((low | (high << 4)) - 32).to(tl.float32)
    return (_f16(blk) * scale) * tl.load(lut + _nibble(blk + 8 + 16 * s, j))


@triton.jit
def _round_to_bf16(v):
    """fp32 v rounded to the nearest bfloat16 (ties to even), still as fp32. The interpreter's own fp32 ->
    bf16 cast drops the low bits instead; a GPU's cast rounds like this, so this runs only interpreted."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


DEQUANTIZE = {"q5_0": _q5_0, "q5_1": _q5_1, "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k,
              "q6_k": _q6_k, "iq4_nl": _iq4_nl, "iq4_xs": _iq4_xs}
TYPES = frozenset(DEQUANTIZE)


@triton.jit
def _ggml_linear_kernel(x_ptr, w_ptr, lut, b_ptr, y_ptr, M, N, K,
                        DEQUANT: tl.constexpr, ELEMENTS: tl.constexpr, NBYTES: tl.constexpr,
                        HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, OUT_DTYPE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]          # y of a long prompt's logits can pass 2^31 elements
    x_rows = x_ptr + rows64 * K
    # Rows past N read row N - 1 (their results are not stored), so the helpers need no masks.
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * ((K // ELEMENTS) * NBYTES)
    j = tl.arange(0, RUN)[None, :]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)   # tl.zeros is itself jitted: see reductions.py
    for b in range(0, K // ELEMENTS):
        blk = w_rows + b * NBYTES
        for s in tl.static_range(ELEMENTS // RUN):   # pyright: ignore[reportGeneralTypeIssues] (Triton's stub)
            k0 = b * ELEMENTS + s * RUN
            x = tl.load(x_rows + k0 + j, mask=row_ok[:, None], other=0.0)
            w = DEQUANT(blk, s, j, lut)                     # [BLOCK_N, RUN] fp32
            if ROUND_BF16:
                w = _round_to_bf16(w)
            w = w.to(OUT_DTYPE)                             # rounded to x's dtype, as the reference rounds
            acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w).to(DOT_DTYPE), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = _round_to_bf16(acc)
    tl.store(y_ptr + rows64 * N + cols[None, :], acc.to(OUT_DTYPE), mask=row_ok[:, None] & (cols < N)[None, :])


@functools.cache
def _iq4_table(device: torch.device) -> torch.Tensor:
    # Made on the first call on a device (an eager call: CUDA graphs warm up before they capture).
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)


def tiles(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for m rows of x. Up to 16 rows (decode) the smallest tile tl.dot takes, and on a GPU
    32 weight rows a program, so a 4096-row weight makes 128 programs (about one an SM) rather than 64.
    Under the interpreter 64 (every program runs in turn there, and the tests cross a 64-row tile)."""
    if m <= 16:
        return 16, 64 if INTERPRETED else 32
    if m <= 32:
        return 32, 64
    return 64, 64


def ggml_linear(x: torch.Tensor, weight: GGMLWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float16 / bfloat16 / float32 @ dequantize(weight)^T (+ bias), in x's dtype."""
    if weight.type_name not in DEQUANTIZE:
        raise ValueError(f"ggml_linear: no kernel for GGML type {weight.type_name!r} (kernels: {', '.join(TYPES)})")
    weight.check()
    x = x.contiguous()
    m, k = x.shape
    n = weight.out_features
    if k != weight.in_features:
        raise ValueError(f"ggml_linear: x has {k} inputs, the weight {weight.in_features}")
    t = weight.block_type
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n = tiles(m)
    dot_dtype, precision = dot_args(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _ggml_linear_kernel[grid](
        x, weight.blocks, _iq4_table(x.device), bias if bias is not None else x, y, m, n, k,
        DEQUANT=DEQUANTIZE[t.name], ELEMENTS=t.elements, NBYTES=t.nbytes, HAS_BIAS=bias is not None,
        ROUND_BF16=INTERPRETED and x.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n, RUN=RUN,
        DOT_DTYPE=dot_dtype, PRECISION=precision, OUT_DTYPE=tl_dtype(x.dtype))
    return y
