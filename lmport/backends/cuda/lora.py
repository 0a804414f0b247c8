"""LoRA over a batch of mixed adapters as a Triton grouped GEMM (matches ``lmport.ops.add_lora``).

The step's rows that use an adapter come grouped by slot in tiles of LORA_TILE rows
(``LoraBatch.tile_rows``/``tile_slots``, built on the host once a step), so every tile is one
adapter's and runs as one GEMM against that slot's weights; base-model rows are in no tile. Two
launches a linear: shrink, s = x @ A[slot]^T ([rows, R]), then expand, y += s @ B[slot]^T in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import INTERPRETED, dot_args, pow2
from lmport.ops.lora import LORA_TILE, LoraBatch


@triton.jit
def _lora_gemm(a, w, c, tile_rows, tile_slots, N, K, s_am, s_ak, s_wl, s_wn, s_wk, s_cm, s_cn,
               ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """c[row] (+)= a[row] @ w[slot]^T for the tile's rows, slot = the tile's."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slots + tile).to(tl.int64)
    rows = tl.load(tile_rows + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows >= 0                                   # the padding of a slot's run
    rows = tl.where(valid, rows, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    w_slot = w + slot * s_wl
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        at = tl.load(a + rows[:, None] * s_am + offs_k[None, :] * s_ak,
                     mask=valid[:, None] & mask_k[None, :], other=0.0).to(DOT_DTYPE)
        wt = tl.load(w_slot + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk,
                     mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(DOT_DTYPE)
        acc += tl.dot(at, wt, input_precision=DOT_PREC)
    ptrs = c + rows[:, None] * s_cm + offs_n[None, :] * s_cn
    mask = valid[:, None] & mask_n[None, :]
    if ADD:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(c.dtype.element_ty), mask=mask)


def _gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, batch: LoraBatch, add: bool) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n = min(32 if INTERPRETED else 64, pow2(max(n, 16)))
    block_k = min(32 if INTERPRETED else 64, pow2(max(k, 16)))
    dot_dtype, dot_prec = dot_args(a.dtype)
    grid = (batch.tile_slots.shape[0], triton.cdiv(n, block_n))
    _lora_gemm[grid](a, w, c, batch.tile_rows, batch.tile_slots, n, k, *a.stride(), *w.stride(), *c.stride(),
                     ADD=add, BLOCK_M=LORA_TILE, BLOCK_N=block_n, BLOCK_K=block_k,
                     DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec, num_warps=4)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             batch: LoraBatch) -> torch.Tensor:
    # Rows outside every tile (the base model's) are never written in s nor read from it.
    s = torch.empty(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
    _gemm(x, lora_a, s, batch, add=False)
    _gemm(s, lora_b, y, batch, add=True)
    return y
