"""Paged decode attention: split-K over each sequence's KV, then a reduction.

Matches ``lmport.ops.paged_attention`` when ``meta.is_decode`` (one new token
a sequence). Stage 1 runs one program per (sequence, KV head, split): the
query heads that share the KV head (GQA group, padded to >= 16 rows for
``tl.dot``) attend to the split's tokens, gathered through the block table and
dequantized inline (or, for a quantized K, scored from its codes: the tiling
says which), with an online softmax. Stage 2 merges the splits of each
(sequence, query head) by their log-sum-exp, adding the head's sink logit to the
denominator where the layer has sinks (gpt-oss). A window or a chunk (Llama 4's
local layers) hides the keys before it. Splitting the KV keeps the GPU
full when batch x KV heads is small and contexts are long. Over a quantized
cache (NEW) the sequence's own new key and value are read as computed, not from
their codes: the split holding the last position adds that key as one more step
of its online softmax after its tiles of history.

Work is sized from host ints only (``meta.max_kv_len``, shapes): no syncs,
and a larger ``max_kv_len`` than any real length (e.g. the fixed bound of a
captured CUDA graph) is still correct, the extra splits exit at once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import (cache_values, dot_args, kernel_quant, new_kv_args, pow2, qparam_args,
                                         sm_count, tl_dtype)
from lmport.backends.cuda.paged_kv import load_int4_halves, load_kv_tile, load_qparams
from lmport.backends.cuda.prefill_attention import sinks_log2
from lmport.backends.cuda.reductions import MAX, SUM
from lmport.backends.cuda.soft_cap import soft_cap_log2
from lmport.kv.layout import LayerCache
from lmport.ops.metadata import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(q, k_cache, v_cache, k_qp, v_qp, k_new, v_new, block_tables, kv_lens, part_out, part_lse,
                  sm_scale_log2, tokens_per_split, window, chunk, softcap,
                  sq_t, sq_h, sq_d, st_b, st_n, sn_t, sn_h, sn_d,
                  c_b, c_s, c_h, c_d, p_b, p_s, p_h, p_2,
                  po_b, po_h, po_s, pl_b, pl_h,
                  GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  QUANT: tl.constexpr, ATT_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr, K_CODES: tl.constexpr, NEW: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens + seq)
    # A sliding window (window > 0) or a chunk (chunk > 0) hides the keys before lo; whole tiles of them are
    # skipped.
    lo = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    lo = tl.maximum(lo, tl.where(chunk > 0, (kv_len - 1) // tl.maximum(chunk, 1) * chunk, 0))
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, kv_len)
    owns_new = (end == kv_len) & (start < kv_len)   # this split holds the new token's position
    if NEW:   # the tiles cover the history; the new token comes after them
        end = tl.minimum(end, kv_len - 1)
        end = tl.where(lo < end, end, 0)   # no visible history here: no tile (a tile of none would make m NaN)
    start = tl.maximum(start, lo // BLOCK_N * BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    qt = tl.load(q + seq * sq_t + heads[:, None] * sq_h + offs_d[None, :] * sq_d,
                 mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

    k_head = k_cache + kv_head * c_h
    v_head = v_cache + kv_head * c_h
    kp_head = k_qp + kv_head * p_h
    vp_head = v_qp + kv_head * p_h
    table = block_tables + seq * st_b

    # An INT4 row's low nibbles are its even elements and the high ones its odd elements: q and the output
    # are split the same way, so the tiles are never interleaved (load_int4_halves).
    offs_b = tl.arange(0, BLOCK_D // 2)
    mask_b = offs_b < HEAD_DIM // 2
    q_even, q_odd = tl.split(tl.reshape(qt, (BLOCK_G, BLOCK_D // 2, 2)))
    # Scores from K's codes (K_CODES): q . ((c - zero) * scale) = (q . c - zero * sum(q)) * scale.
    q_sum = tl.sum(qt.to(tl.float32), 1)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    acc_even = tl.full([BLOCK_G, BLOCK_D // 2], 0.0, tl.float32)   # QUANT == 4: acc's even and odd columns
    acc_odd = tl.full([BLOCK_G, BLOCK_D // 2], 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = (offs_n < end) & (offs_n >= lo)   # every tile holds a key >= lo: m stays finite
        block_ids = tl.load(table + (offs_n // PAGE) * st_n, mask=mask_n, other=0)
        slots = offs_n % PAGE
        if K_CODES:
            rows = block_ids.to(tl.int64) * c_b + slots * c_s
            scale, zero = load_qparams(kp_head, block_ids, slots, mask_n, p_b, p_s, p_2)
            if QUANT == 4:
                codes = tl.load(k_head + rows[:, None] + offs_b[None, :] * c_d,
                                mask=mask_n[:, None] & mask_b[None, :], other=0)
                s = tl.dot(q_even, tl.trans((codes & 0xF).to(DOT_DTYPE)), input_precision=DOT_PREC)
                s += tl.dot(q_odd, tl.trans((codes >> 4).to(DOT_DTYPE)), input_precision=DOT_PREC)
            else:
                codes = tl.load(k_head + rows[:, None] + offs_d[None, :] * c_d,
                                mask=mask_n[:, None] & mask_d[None, :], other=0)
                s = tl.dot(qt, tl.trans(codes.to(DOT_DTYPE)), input_precision=DOT_PREC)
            s = (s - q_sum[:, None] * zero[None, :]) * (scale * sm_scale_log2)[None, :]
        else:
            kt = load_kv_tile(k_head, kp_head, block_ids, slots, offs_d, mask_n, mask_d,
                              c_b, c_s, c_d, p_b, p_s, p_2, QUANT, ATT_DTYPE).to(DOT_DTYPE)
            s = tl.dot(qt, tl.trans(kt), input_precision=DOT_PREC) * sm_scale_log2
        if SOFTCAP:
            s = soft_cap_log2(s, softcap)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, MAX))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.reduce(p, 1, SUM)
        if QUANT == 4:
            v_even, v_odd = load_int4_halves(v_head, vp_head, block_ids, slots, offs_b, mask_n, mask_b,
                                             c_b, c_s, c_d, p_b, p_s, p_2, ATT_DTYPE)
            acc_even = acc_even * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v_even.to(DOT_DTYPE),
                                                          input_precision=DOT_PREC)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v_odd.to(DOT_DTYPE),
                                                        input_precision=DOT_PREC)
        else:
            vt = load_kv_tile(v_head, vp_head, block_ids, slots, offs_d, mask_n, mask_d,
                              c_b, c_s, c_d, p_b, p_s, p_2, QUANT, ATT_DTYPE).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), vt, input_precision=DOT_PREC)
        m = m_new

    if QUANT == 4:
        acc = tl.interleave(acc_even, acc_odd)
    if NEW:   # the new token, as computed: one more step of the online softmax in the split that holds it
        new_row = seq * sn_t + kv_head * sn_h
        kn = tl.load(k_new + new_row + offs_d * sn_d, mask=mask_d, other=0.0).to(tl.float32)
        vn = tl.load(v_new + new_row + offs_d * sn_d, mask=mask_d, other=0.0).to(tl.float32)
        s_new = tl.sum(qt.to(tl.float32) * kn[None, :], 1) * sm_scale_log2
        if SOFTCAP:
            s_new = soft_cap_log2(s_new, softcap)
        s_new = tl.where(owns_new, s_new, float("-inf"))
        m_new = tl.maximum(m, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a split with no key at all keeps l = 0
        alpha = tl.exp2(m - m_safe)
        p_new = tl.exp2(s_new - m_safe)
        l = l * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * vn[None, :]
        m = m_new

    # An empty split (past this sequence's end, or before its window) leaves l = 0: weight 0 in the reduction.
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(part_out + seq * po_b + heads[:, None] * po_h + split * po_s + offs_d[None, :], out,
             mask=mask_g[:, None] & mask_d[None, :])
    tl.store(part_lse + seq * pl_b + heads * pl_h + split, lse, mask=mask_g)


@triton.jit
def _reduce_kernel(part_out, part_lse, o, num_splits, sinks_log2,
                   po_b, po_h, po_s, pl_b, pl_h, so_t, so_h, so_d,
                   HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(part_lse + seq * pl_b + head * pl_h + offs_s, mask=mask_s, other=float("-inf"))
    top = tl.reduce(lse, 0, MAX)                   # the split of the last key holds tokens: the max is finite
    w = tl.exp2(lse - top)
    parts = tl.load(part_out + seq * po_b + head * po_h + offs_s[:, None] * po_s + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    denominator = tl.reduce(w, 0, SUM)
    if SINKS:   # the head's sink logit (log2 units, like the scores) joins the denominator
        denominator += tl.exp2(tl.load(sinks_log2 + head) - top)
    out = tl.reduce(w[:, None] * parts, 0, SUM) / denominator  # pyright: ignore[reportOperatorIssue]
    tl.store(o + seq * so_t + head * so_h + offs_d * so_d, out.to(o.dtype.element_ty), mask=mask_d)


class DecodeTiling(NamedTuple):
    """How the split kernel walks a sequence's KV: tokens a tile, warps and pipeline stages a program, and
    whether a quantized K is scored from its codes (the scale and zero applied to the scores, not to K)."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    k_codes: bool = False


def decode_tiling(quant_policy: int | str) -> DecodeTiling:
    """The fastest of ``lmport bench kernels cuda --tilings`` on an H200 at both of its shapes (docs/cuda.md)
    for INT8 and INT4; fp8, not measured yet, takes the unquantized cache's."""
    return DecodeTiling(128, 4, 2, True) if quant_policy in (4, 8) else DecodeTiling()


def _splits(batch: int, kv_heads: int, max_kv_len: int, block_n: int, device: torch.device) -> int:
    """KV splits a sequence: enough programs for ~2 waves of the GPU, at least one tile each."""
    tiles = triton.cdiv(max_kv_len, block_n)
    want = triton.cdiv(2 * sm_count(device), batch * kv_heads)
    return max(1, min(want, tiles, 64))


def decode_attention(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, softmax_scale: float,
                     num_splits: int | None = None, tiling: DecodeTiling | None = None,
                     new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (one token a sequence) -> [B, Hq, D]; ``new_kv``: the step's K and V [B, Hkv, D], read in place
    of their copies in a quantized cache."""
    batch, q_heads, head_dim = q.shape
    kv_heads = cache.k.shape[2]
    group = q_heads // kv_heads
    tiling = tiling or decode_tiling(cache.quant_policy)
    block_n = tiling.block_n
    if num_splits is None:
        num_splits = _splits(batch, kv_heads, meta.max_kv_len, block_n, q.device)
    # Each split covers whole tiles; recount so no split starts past max_kv_len.
    tokens_per_split = triton.cdiv(triton.cdiv(meta.max_kv_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(meta.max_kv_len, tokens_per_split)

    part_out = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    k_qp, v_qp, p_strides = qparam_args(cache)
    k_new, v_new, *new_strides, new = new_kv_args(q, cache, new_kv)
    k_cache, v_cache = cache_values(cache)
    policy = kernel_quant(cache)
    dot_dtype, dot_prec = dot_args(q.dtype)
    block_d = pow2(head_dim)
    _split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, k_qp, v_qp, k_new, v_new, meta.block_tables, meta.kv_lens, part_out, part_lse,
        softmax_scale * LOG2E, tokens_per_split, meta.window or 0, meta.chunk or 0, meta.softcap or 0.0,
        *q.stride(), *meta.block_tables.stride(), *new_strides, *cache.k.stride(), *p_strides,
        *part_out.stride()[:3], *part_lse.stride()[:2],
        GROUP=group, PAGE=cache.block_size, HEAD_DIM=head_dim,
        BLOCK_G=max(16, pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        QUANT=policy, ATT_DTYPE=tl_dtype(q.dtype), DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec,
        SOFTCAP=meta.softcap is not None, K_CODES=tiling.k_codes and policy in (4, 8), NEW=new,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    _reduce_kernel[(batch, q_heads)](
        part_out, part_lse, out, num_splits, sinks_log2(meta, q.device),
        *part_out.stride()[:3], *part_lse.stride()[:2], *out.stride(),
        HEAD_DIM=head_dim, BLOCK_S=pow2(num_splits), BLOCK_D=block_d, SINKS=meta.sinks is not None,
        num_warps=4 if block_d >= 128 else 2,
    )
    return out
