"""x @ W^T (+ bias) with W in lmport's int4 / int8 format (docs/weight-quantization.md): W4A16 / W8A16.

A program computes a BLOCK_M x BLOCK_N tile of y, stepping through the inputs one run of 32 at
a time: the run's codes are read from the packed weight (4-bit: input j of a run in the low nibble
of byte j, input j + 16 in the high nibble of byte j), dequantized in registers with the group's
float16 scale and min (w = scale * q + min, in fp32), and multiplied with x by ``tl.dot`` into an
fp32 accumulator. The weight is read once per BLOCK_M rows of x.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import dot_args, tl_dtype
from lmport.weights.format import QuantizedWeight

RUN = 32


@triton.jit
def _quant_linear_kernel(x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, GROUPS,
                         BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, OUT_DTYPE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, RUN)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)   # tl.zeros is itself jitted: see reductions.py
    for k0 in range(0, K, RUN):
        x = tl.load(x_ptr + rows[:, None] * K + (k0 + j)[None, :], mask=row_ok[:, None], other=0.0)
        if BITS == 4:
            byte = tl.load(q_ptr + cols[:, None] * (K // 2) + (k0 // 2 + j % 16)[None, :], mask=col_ok[:, None],
                           other=0).to(tl.int32)
            codes = (byte >> ((j // 16) * 4)[None, :]) & 15
        else:
            codes = tl.load(q_ptr + cols[:, None] * K + (k0 + j)[None, :], mask=col_ok[:, None], other=0).to(tl.int32)
        g = k0 // GROUP
        scale = tl.load(s_ptr + cols * GROUPS + g, mask=col_ok, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + cols * GROUPS + g, mask=col_ok, other=0.0).to(tl.float32)
        w = codes.to(tl.float32) * scale[:, None] + mn[:, None]          # [BLOCK_N, RUN]
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w).to(DOT_DTYPE), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(OUT_DTYPE), mask=row_ok[:, None] & col_ok[None, :])


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    n = weight.out_features
    if k != weight.in_features:
        raise ValueError(f"quant_linear: x has {k} inputs, the weight {weight.in_features}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32
    block_n = 64
    dot_dtype, precision = dot_args(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_linear_kernel[grid](
        x, weight.qweight, weight.scales, weight.mins, bias if bias is not None else x, y, m, n, k,
        k // weight.group_size, BITS=weight.bits, GROUP=weight.group_size, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, RUN=RUN, DOT_DTYPE=dot_dtype, PRECISION=precision,
        OUT_DTYPE=tl_dtype(x.dtype))
    return y
