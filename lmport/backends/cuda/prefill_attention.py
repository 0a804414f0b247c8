"""Paged prefill attention: new tokens over the cached history plus themselves.

Matches ``lmport.ops.paged_attention`` for any batch (varlen; chunked prefill;
decode rows mixed in). The new tokens' K/V are already in the cache, so every
key comes from the paged cache, gathered through the block table and
dequantized inline; except over a quantized cache given the step's K and V
(NEW): the step's own positions then read those, as computed, and only the
history comes from the codes. A program owns one sequence, one KV head and a tile of
BLOCK_M rows, each row a (new token, query head of the GQA group) pair: the
group's query heads share every K/V tile they load. Keys all rows of the tile
see (below the tile's first position) run unmasked; the causal tail is masked. Under a
sliding window or a chunk (Llama 4's local layers: a row sees its own chunk only) every tile from the
first one a row can see is masked per row. With sinks (gpt-oss), each head's sink logit joins the
softmax's denominator once every tile is summed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import (INTERPRETED, cache_values, dot_args, kernel_quant, new_kv_args, pow2,
                                         qparam_args, tl_dtype)
from lmport.backends.cuda.paged_kv import load_kv_tile
from lmport.backends.cuda.reductions import MAX, SUM
from lmport.backends.cuda.soft_cap import soft_cap_log2
from lmport.kv.layout import LayerCache
from lmport.ops.metadata import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _tile(head, qp_head, new_head, block_ids, slots, offs_n, ctx, new_row0, offs_d, mask_n, mask_d,
          c_b, c_s, c_d, p_b, p_s, p_2, sn_t, sn_d, QUANT: tl.constexpr, ATT_DTYPE: tl.constexpr, NEW: tl.constexpr):
    """A K or V tile: from the cache, or (NEW) the step's own positions (>= ctx) from its rows as computed."""
    if NEW:
        own = offs_n >= ctx
        cached = load_kv_tile(head, qp_head, block_ids, slots, offs_d, mask_n & ~own, mask_d,
                              c_b, c_s, c_d, p_b, p_s, p_2, QUANT, ATT_DTYPE)
        rows = new_row0 + tl.where(own, offs_n - ctx, 0)
        fresh = tl.load(new_head + rows[:, None] * sn_t + offs_d[None, :] * sn_d,
                        mask=(mask_n & own)[:, None] & mask_d[None, :], other=0.0).to(ATT_DTYPE)
        return tl.where(own[:, None], fresh, cached)
    else:
        return load_kv_tile(head, qp_head, block_ids, slots, offs_d, mask_n, mask_d,
                            c_b, c_s, c_d, p_b, p_s, p_2, QUANT, ATT_DTYPE)


@triton.jit
def _attend(qt, m, l, acc, n0, kv_len, q_pos, table, st_n, offs_d, mask_d,
            k_head, v_head, kp_head, vp_head, c_b, c_s, c_d, p_b, p_s, p_2, sm_scale_log2, first, softcap,
            kn_head, vn_head, ctx, new_row0, sn_t, sn_d,
            CAUSAL: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
            ATT_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
            WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, NEW: tl.constexpr):
    """One K/V tile of the online softmax: returns the updated (m, l, acc). WINDOWED: keys before each row's
    ``first`` visible position (its window's or its chunk's start) are masked too, and a row may see no key
    of a tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < kv_len
    block_ids = tl.load(table + (offs_n // PAGE) * st_n, mask=mask_n, other=0)
    slots = offs_n % PAGE
    kt = _tile(k_head, kp_head, kn_head, block_ids, slots, offs_n, ctx, new_row0, offs_d, mask_n, mask_d,
               c_b, c_s, c_d, p_b, p_s, p_2, sn_t, sn_d, QUANT, ATT_DTYPE, NEW).to(DOT_DTYPE)
    s = tl.dot(qt, tl.trans(kt), input_precision=DOT_PREC) * sm_scale_log2
    if SOFTCAP:
        s = soft_cap_log2(s, softcap)
    if CAUSAL:
        seen = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if WINDOWED:
            seen = seen & (offs_n[None, :] >= first[:, None])
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.reduce(s, 1, MAX))
    if WINDOWED:  # a row with no key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.reduce(p, 1, SUM)
    vt = _tile(v_head, vp_head, vn_head, block_ids, slots, offs_n, ctx, new_row0, offs_d, mask_n, mask_d,
               c_b, c_s, c_d, p_b, p_s, p_2, sn_t, sn_d, QUANT, ATT_DTYPE, NEW).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), vt, input_precision=DOT_PREC)
    return m_new, l, acc


@triton.jit
def _prefill_kernel(q, o, k_cache, v_cache, k_qp, v_qp, k_new, v_new, block_tables, q_start_loc, q_lens, kv_lens,
                    sm_scale_log2, window, chunk, softcap, sinks_log2,
                    sq_t, sq_h, sq_d, so_t, so_h, so_d, st_b, st_n, sn_t, sn_h, sn_d,
                    c_b, c_s, c_h, c_d, p_b, p_s, p_h, p_2,
                    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    TOK_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, QUANT: tl.constexpr, ATT_DTYPE: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, WINDOWED: tl.constexpr,
                    SOFTCAP: tl.constexpr, SINKS: tl.constexpr, NEW: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_len = tl.load(q_lens + seq)
    tok0 = tile * TOK_M                        # first new token of this tile
    if tok0 < q_len:
        kv_len = tl.load(kv_lens + seq)
        ctx = kv_len - q_len                   # cached history before the new tokens
        q_row0 = tl.load(q_start_loc + seq).to(tl.int64)

        # Row r is new token tok0 + r // GROUP, query head kv_head * GROUP + r % GROUP.
        offs_r = tl.arange(0, BLOCK_M)
        tok = tok0 + offs_r // GROUP
        heads = kv_head * GROUP + offs_r % GROUP
        valid = (offs_r < TOK_M * GROUP) & (tok < q_len)
        q_pos = ctx + tok
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        rows = (q_row0 + tok) * sq_t + heads * sq_h
        qt = tl.load(q + rows[:, None] + offs_d[None, :] * sq_d,
                     mask=valid[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

        k_head = k_cache + kv_head * c_h
        v_head = v_cache + kv_head * c_h
        kp_head = k_qp + kv_head * p_h
        vp_head = v_qp + kv_head * p_h
        kn_head = k_new + kv_head * sn_h
        vn_head = v_new + kv_head * sn_h
        table = block_tables + seq * st_b

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        hi = tl.minimum(kv_len, ctx + tok0 + TOK_M)
        if WINDOWED:
            # Each row's first visible key: its window's start (window > 0), its chunk's (chunk > 0), the later.
            first = tl.maximum(tl.where(window > 0, q_pos - window + 1, 0),
                               tl.where(chunk > 0, q_pos // tl.maximum(chunk, 1) * chunk, 0))
            # Every tile from the one holding the first row's first visible key is masked per row.
            p0 = ctx + tok0
            lo = tl.maximum(tl.where(window > 0, p0 - window + 1, 0),
                            tl.where(chunk > 0, p0 // tl.maximum(chunk, 1) * chunk, 0))
            lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
            for n0 in range(lo, hi, BLOCK_N):
                m, l, acc = _attend(qt, m, l, acc, n0, kv_len, q_pos, table, st_n, offs_d, mask_d,
                                    k_head, v_head, kp_head, vp_head, c_b, c_s, c_d, p_b, p_s, p_2,
                                    sm_scale_log2, first, softcap, kn_head, vn_head, ctx, q_row0, sn_t, sn_d,
                                    True, PAGE, BLOCK_N, QUANT, ATT_DTYPE, DOT_DTYPE, DOT_PREC, True, SOFTCAP, NEW)
        else:
            # Keys before ctx + tok0 are visible to every row: whole tiles of them need no mask.
            full_end = (ctx + tok0) // BLOCK_N * BLOCK_N
            for n0 in range(0, full_end, BLOCK_N):
                m, l, acc = _attend(qt, m, l, acc, n0, kv_len, q_pos, table, st_n, offs_d, mask_d,
                                    k_head, v_head, kp_head, vp_head, c_b, c_s, c_d, p_b, p_s, p_2,
                                    sm_scale_log2, q_pos, softcap, kn_head, vn_head, ctx, q_row0, sn_t, sn_d,
                                    False, PAGE, BLOCK_N, QUANT, ATT_DTYPE, DOT_DTYPE, DOT_PREC, False, SOFTCAP, NEW)
            # Every row sees key full_end <= its position, so m is finite after the first tile.
            for n0 in range(full_end, hi, BLOCK_N):
                m, l, acc = _attend(qt, m, l, acc, n0, kv_len, q_pos, table, st_n, offs_d, mask_d,
                                    k_head, v_head, kp_head, vp_head, c_b, c_s, c_d, p_b, p_s, p_2,
                                    sm_scale_log2, q_pos, softcap, kn_head, vn_head, ctx, q_row0, sn_t, sn_d,
                                    True, PAGE, BLOCK_N, QUANT, ATT_DTYPE, DOT_DTYPE, DOT_PREC, False, SOFTCAP, NEW)

        if SINKS:   # each head's sink logit (log2 units, like the scores) joins the denominator
            l += tl.exp2(tl.load(sinks_log2 + heads, mask=valid, other=0.0) - m)
        out = acc / tl.where(l > 0, l, 1.0)[:, None]   # l = 0 only on padded rows, which are not stored
        out_rows = (q_row0 + tok) * so_t + heads * so_h
        tl.store(o + out_rows[:, None] + offs_d[None, :] * so_d, out.to(o.dtype.element_ty),
                 mask=valid[:, None] & mask_d[None, :])


def sinks_log2(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """The layer's sink logits in the kernels' log2 units (float32), or an empty tensor where it has none."""
    if meta.sinks is None:
        return torch.empty(0, dtype=torch.float32, device=device)
    return meta.sinks.float() * LOG2E


def tile_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for Hopper-class GPUs.

    128 rows x 64 keys keeps the [128, D] fp32 accumulator in registers for
    D <= 128 with 8 warps; smaller heads can afford deeper pipelining. Under
    the interpreter smaller tiles are cheaper and exercise the multi-tile
    paths at test shapes.
    """
    if INTERPRETED:
        return 32, 32, 4, 1
    d = pow2(head_dim)
    if d <= 64:
        return 128, 64, 4, 3
    if d <= 128:
        return 128, 64, 8, 2
    return 64, 32, 8, 2


def prefill_attention(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, softmax_scale: float,
                      config: tuple[int, int, int, int] | None = None,
                      new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]; causal over each sequence's absolute positions (within the layer's window
    or chunk where it has one; its sinks in the denominator where it has them). ``new_kv``: the step's K and V
    [T, Hkv, D], read in place of their copies in a quantized cache."""
    _, q_heads, head_dim = q.shape
    kv_heads = cache.k.shape[2]
    group = q_heads // kv_heads
    block_m, block_n, num_warps, num_stages = config or tile_config(head_dim)
    block_m = max(block_m, pow2(group))        # a tile holds at least one token's whole group
    tok_m = block_m // group
    out = torch.empty_like(q)
    k_qp, v_qp, p_strides = qparam_args(cache)
    k_new, v_new, *new_strides, new = new_kv_args(q, cache, new_kv)
    k_cache, v_cache = cache_values(cache)
    dot_dtype, dot_prec = dot_args(q.dtype)
    grid = (triton.cdiv(meta.max_q_len, tok_m), kv_heads, meta.num_seqs)
    _prefill_kernel[grid](
        q, out, k_cache, v_cache, k_qp, v_qp, k_new, v_new, meta.block_tables, meta.q_start_loc, meta.q_lens,
        meta.kv_lens, softmax_scale * LOG2E, meta.window or 0, meta.chunk or 0, meta.softcap or 0.0,
        sinks_log2(meta, q.device),
        *q.stride(), *out.stride(), *meta.block_tables.stride(), *new_strides, *cache.k.stride(), *p_strides,
        GROUP=group, PAGE=cache.block_size, HEAD_DIM=head_dim, TOK_M=tok_m, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=pow2(head_dim), QUANT=kernel_quant(cache),
        ATT_DTYPE=tl_dtype(q.dtype), DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec,
        WINDOWED=meta.window is not None or meta.chunk is not None, SOFTCAP=meta.softcap is not None,
        SINKS=meta.sinks is not None, NEW=new,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
