"""x @ W^T (+ bias) with W float8 e4m3 and a scale per block of weights (lmport.weights.fp8): W8A16.

One kernel for the three scale layouts, which differ only in the block a scale covers (per-tensor: the whole
weight; per-channel: a row; block-scaled: 128 x 128). A program computes a BLOCK_M x BLOCK_N tile of y,
stepping through the inputs BLOCK_K at a time: the tile's weight bytes are decoded to float32 with integer
arithmetic (paged_kv.decode_e4m3, exactly as torch casts them, so no fp8 hardware is needed and the kernel runs
on every GPU the other kernels run on), multiplied by each weight's block scale in float32 (rounded to a 16-bit
scale's dtype, as lmport.weights.fp8.dequantize does), and multiplied with
x by ``tl.dot`` into a float32 accumulator. The weight is read once per BLOCK_M rows of x.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import dot_args, tl_dtype
from lmport.backends.cuda.paged_kv import decode_e4m3
from lmport.weights.fp8 import Fp8Weight


@triton.jit
def _fp8_linear_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, SCALE_COLS, BLOCK_OUT, BLOCK_IN,
                       SCALE_DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       PRECISION: tl.constexpr, OUT_DTYPE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    scale_rows = (cols // BLOCK_OUT).to(tl.int64) * SCALE_COLS
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)   # tl.zeros is itself jitted: see reductions.py
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + j
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        raw = tl.load(q_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=w_mask, other=0).to(tl.int32)
        scale = tl.load(s_ptr + scale_rows[:, None] + (ks // BLOCK_IN)[None, :], mask=w_mask, other=0.0)
        w = decode_e4m3(raw) * scale                                     # [BLOCK_N, BLOCK_K], exact in float32
        if SCALE_DTYPE == tl.bfloat16:   # a 16-bit scale's product is rounded to its dtype, as the reference does
            w = round_to_bfloat16(w)
        elif SCALE_DTYPE == tl.float16:
            w = w.to(tl.float16).to(tl.float32)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w).to(DOT_DTYPE), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(OUT_DTYPE), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def round_to_bfloat16(w):
    """float32 ``w`` rounded to bfloat16's 8 significant bits, to nearest even, as torch casts it (held in float32).
    Integer arithmetic, because the interpreter's float32 -> bfloat16 cast truncates."""
    bits = w.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(weight)^T (+ bias) -> [M, N] in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.out_features
    if k != weight.in_features:
        raise ValueError(f"fp8_linear: x has {k} inputs, the weight {weight.in_features}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 32
    dot_dtype, precision = dot_args(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    scale = weight.scale.float().contiguous()   # float32 already, except compressed-tensors' 16-bit scales
    _fp8_linear_kernel[grid](
        x, weight.qweight.view(torch.uint8), scale, bias if bias is not None else x, y, m, n, k, scale.shape[1],
        weight.block_out, weight.block_in, SCALE_DTYPE=tl_dtype(weight.scale.dtype), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot_dtype, PRECISION=precision,
        OUT_DTYPE=tl_dtype(x.dtype))
    return y
