"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache: the cuda backend's kernels.

Matches ``lmport.ops.fill_latent_cache`` and ``lmport.ops.latent_attention``. A latent layer caches one vector a
token, ``[c, k_rope]`` (``kv_lora_rank`` + ``qk_rope_head_dim`` values: 512 + 64 in DeepSeek-V3), shared by every
query head. With kv_b_proj's key rows absorbed into the query (``q_nope W_k``, a query in latent space), attention
is multi-query attention with one KV head whose key is the whole cached vector and whose value is its first
``kv_lora_rank`` values, the ``c`` (vLLM's Triton MLA backend does the same). The kernel loads each tile of latents
once and uses its ``c`` part for the scores and for the values, its rope part for the scores only; the two parts
are tiled separately (BLOCK_C, BLOCK_R: each its own power of two, padded lanes masked), so 512 + 64 needs no
padding to 1024. The absorption before (``q_nope W_k``) and the value rows after (``W_v``, on each head's weighted
sum of ``c``s) are the model's per-head projections (``Backend.head_linear``).

Every sequence runs this way, prefill (chunks over history) and decode alike: a program owns one sequence, a
tile of rows, each a (new token, query head) pair that all share its latent tiles, and a split of the keys.
Decode steps split the keys (split-K, merged by ``decode_attention``'s log-sum-exp reduction) so a small batch
still fills the GPU; prefill runs one split.

A quantized cache (8, 4, fp8) is dequantized per tile as ``paged_attention`` dequantizes K and V
(``paged_kv.load_kv_tile``); given the step's latents (``new_latent``), the step's own positions read those as
computed, not their codes, as the reference does. The fill quantizes in the same pass (``kv_fill``'s rows, one
head a token).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from lmport.backends.cuda.decode_attention import _reduce_kernel
from lmport.backends.cuda.kv_fill import _fill
from lmport.backends.cuda.launch import INTERPRETED, dot_args, kernel_quant, pow2, sm_count, tl_dtype
from lmport.backends.cuda.prefill_attention import _tile
from lmport.backends.cuda.reductions import MAX, SUM
from lmport.kv import quant
from lmport.kv.layout import LayerCache
from lmport.ops.metadata import AttentionMetadata

LOG2E = 1.4426950408889634


def _require_latent(cache: LayerCache, op: str) -> None:
    cache.require_axis_order("bshd", op)
    if cache.kind != "latent":
        raise ValueError(f"{op} reads a 'latent' cache (one latent a token), not a {cache.kind!r} one")


def _latent_args(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """(values as the kernels address them, quantization params, the params' block, slot, head and pair strides).
    fp8: the bytes and the head's scale with zero block, slot and pair strides (every row reads it); unquantized:
    the values stand in for params the kernels never read."""
    if quant.is_fp8(cache.quant_policy):
        if cache.k_scale is None:
            raise ValueError("an fp8 latent cache needs its scale (LayerCache.k_scale)")
        return cache.k.view(torch.uint8), cache.k_scale, (0, 0, cache.k_scale.stride(0), 0)
    if cache.quant_policy:
        if cache.k_qparams is None:
            raise ValueError(f"a quant_policy={cache.quant_policy} latent cache needs its params (k_qparams)")
        qp = cache.k_qparams
        return cache.k, qp, (qp.stride(0), qp.stride(1), qp.stride(2), qp.stride(3))
    return cache.k, cache.k, (0, 0, 0, 0)


# -- fill ---------------------------------------------------------------------------------------------------------

@triton.jit
def _fill_latent_kernel(latent, cache, qp, slot_mapping, num_rows, s_t, s_d,
                        c_b, c_s, c_h, c_d, p_b, p_s, p_h, p_2,
                        PAGE: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                        QUANT: tl.constexpr, LEVELS: tl.constexpr, EPS: tl.constexpr, ZERO_LIMIT: tl.constexpr,
                        PMAX: tl.constexpr, PDTYPE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slot_mapping + tok, mask=tok < num_rows, other=-1).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    head = tok * 0   # the latent's one "head"
    _fill(latent, s_t, 0, s_d, cache, qp, tok, head, slot // PAGE, slot % PAGE, valid,
          c_b, c_s, c_h, c_d, p_b, p_s, p_h, p_2,
          WIDTH, BLOCK_D, QUANT, LEVELS, EPS, ZERO_LIMIT, PMAX, PDTYPE)


def fill_latent_cache(latent: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """latent [T, width] (``c`` then ``k_rope``); writes token t into slot ``slot_mapping[t]`` (skipped when
    negative), quantized when the cache is."""
    _require_latent(cache, "the cuda fill_latent_cache")
    tokens, width = latent.shape
    if tokens == 0:
        return
    policy = kernel_quant(cache)
    values, qp, p_strides = _latent_args(cache)
    codes = policy in (4, 8)
    pdtype = qp.dtype if codes else torch.float32
    eps = torch.finfo(pdtype).tiny * ((1 << policy) - 1) if codes else 0.0
    block_d = pow2(quant.packed_dim(width, policy))
    rows = 64 if INTERPRETED else max(1, min(64, 2048 // block_d))
    # fp32 max - min may overflow to inf, exactly as in the reference; numpy (interpreter) would warn.
    with np.errstate(over="ignore") if INTERPRETED else contextlib.nullcontext():
        _fill_latent_kernel[(triton.cdiv(tokens, rows),)](
            latent, values, qp, slot_mapping, tokens, *latent.stride(), *cache.k.stride(), *p_strides,
            PAGE=cache.block_size, WIDTH=width, ROWS=rows, BLOCK_D=block_d, QUANT=policy,
            LEVELS=float((1 << policy) - 1) if codes else 0.0, EPS=eps, ZERO_LIMIT=float(quant.ZERO_LIMIT),
            PMAX=torch.finfo(pdtype).max, PDTYPE=tl_dtype(pdtype), num_warps=4,
        )


# -- attention ----------------------------------------------------------------------------------------------------

@triton.jit
def _mla_kernel(q_lat, q_rope, cache, qp, new_latent, block_tables, q_start_loc, q_lens, kv_lens,
                out, part_out, part_lse, sm_scale_log2, tokens_per_split,
                sl_t, sl_h, sl_d, sr_t, sr_h, sr_d, st_b, st_n, sn_t, sn_d,
                c_b, c_s, c_d, p_b, p_s, p_2, so_t, so_h, so_d, po_t, po_h, po_s, pl_t, pl_h,
                HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr,
                TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, QUANT: tl.constexpr, ATT_DTYPE: tl.constexpr,
                DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, NEW: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    tok0 = tile // HEAD_BLOCKS * TOKENS
    q_len = tl.load(q_lens + seq)
    kv_len = tl.load(kv_lens + seq)
    ctx = kv_len - q_len                           # cached history before the step's tokens
    q_row0 = tl.load(q_start_loc + seq).to(tl.int64)

    # Row r is new token tok0 + r // BLOCK_H, query head (tile's head block) + r % BLOCK_H.
    offs_r = tl.arange(0, TOKENS * BLOCK_H)
    tok = tok0 + offs_r // BLOCK_H
    heads = tile % HEAD_BLOCKS * BLOCK_H + offs_r % BLOCK_H
    valid = (tok < q_len) & (heads < HEADS)
    q_pos = ctx + tok
    q_rows = q_row0 + tl.where(tok < q_len, tok, 0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_p = tl.arange(0, BLOCK_R)
    mask_c = offs_c < RANK
    mask_p = offs_p < ROPE
    qc = tl.load(q_lat + (q_rows * sl_t + heads * sl_h)[:, None] + offs_c[None, :] * sl_d,
                 mask=valid[:, None] & mask_c[None, :], other=0.0).to(DOT_DTYPE)
    qr = tl.load(q_rope + (q_rows * sr_t + heads * sr_h)[:, None] + offs_p[None, :] * sr_d,
                 mask=valid[:, None] & mask_p[None, :], other=0.0).to(DOT_DTYPE)

    # This split's keys, up to the last one a row of the tile sees (none for a tile past the sequence's tokens).
    start = split * tokens_per_split
    end = tl.minimum(tl.minimum(start + tokens_per_split, kv_len), ctx + tok0 + TOKENS)
    end = tl.where(tok0 < q_len, end, 0)
    table = block_tables + seq * st_b
    m = tl.full([TOKENS * BLOCK_H], float("-inf"), tl.float32)
    l = tl.full([TOKENS * BLOCK_H], 0.0, tl.float32)
    acc = tl.full([TOKENS * BLOCK_H, BLOCK_C], 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        block_ids = tl.load(table + (offs_n // PAGE) * st_n, mask=mask_n, other=0)
        slots = offs_n % PAGE
        c = _tile(cache, qp, new_latent, block_ids, slots, offs_n, ctx, q_row0, offs_c, mask_n, mask_c,
                  c_b, c_s, c_d, p_b, p_s, p_2, sn_t, sn_d, QUANT, ATT_DTYPE, NEW).to(DOT_DTYPE)
        r = _tile(cache, qp, new_latent, block_ids, slots, offs_n, ctx, q_row0, RANK + offs_p, mask_n, mask_p,
                  c_b, c_s, c_d, p_b, p_s, p_2, sn_t, sn_d, QUANT, ATT_DTYPE, NEW).to(DOT_DTYPE)
        s = tl.dot(qc, tl.trans(c), input_precision=DOT_PREC)
        s += tl.dot(qr, tl.trans(r), input_precision=DOT_PREC)
        seen = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(seen, s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, MAX))
        # A row that has seen no key yet (a padded row) keeps m = -inf: subtract 0, so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.reduce(p, 1, SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision=DOT_PREC)   # the value: c
        m = m_new

    has = l > 0
    o = acc / tl.where(has, l, 1.0)[:, None]
    if SPLIT:   # an empty split (past the sequence's end) has l = 0: weight 0 in the reduction
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(part_out + (q_rows * po_t + heads * po_h + split * po_s)[:, None] + offs_c[None, :], o,
                 mask=valid[:, None] & mask_c[None, :])
        tl.store(part_lse + q_rows * pl_t + heads * pl_h + split, lse, mask=valid)
    else:
        tl.store(out + (q_rows * so_t + heads * so_h)[:, None] + offs_c[None, :] * so_d,
                 o.to(out.dtype.element_ty), mask=valid[:, None] & mask_c[None, :])


def _tiling(heads: int, rank: int, decode: bool) -> tuple[int, int, int, int]:
    """(TOKENS, BLOCK_H, BLOCK_N, num_warps). Decode: one token, 16 heads a program (rows for ``tl.dot``); prefill:
    32 rows of tokens x heads sharing each latent tile. Keys a tile: fewer for wide latents (512), whose
    [keys, rank] tile and [rows, rank] fp32 accumulator fill the registers."""
    block_h = 16 if decode else min(16, pow2(heads))
    tokens = 1 if decode else max(1, 32 // block_h)
    wide = pow2(rank) >= 256
    return tokens, block_h, 16 if wide and not INTERPRETED else 32, 8 if wide and not decode else 4


def latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                     softmax_scale: float, new_latent: torch.Tensor | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """Absorbed MLA: q_lat [T, H, rank] (q_nope W_k), q_rope [T, H, rope] -> [T, H, rank], each head's softmax-weighted
    sum of its sequence's cached ``c``s, causal; ``new_latent`` [T, rank + rope]: the step's latents, read instead
    of their codes in a quantized cache. ``num_splits``: key splits a decode step (default: enough to fill the
    GPU); prefill runs one."""
    _require_latent(cache, "the cuda latent_attention")
    if meta.window is not None or meta.chunk is not None or meta.sinks is not None or meta.softcap is not None:
        raise ValueError("the cuda latent_attention runs full causal attention: no window, chunk, sinks or soft cap")
    t, heads, rank = q_lat.shape
    rope = q_rope.shape[2]
    if cache.k.shape[2] != 1 or q_lat.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"latent attention takes q_lat [T, H, rank] and q_rope [T, H, rope] over a one-head cache; "
                         f"got {tuple(q_lat.shape)}, {tuple(q_rope.shape)} and a cache of {cache.k.shape[2]} heads")
    if quant.packed_dim(rank + rope, cache.quant_policy) != cache.k.shape[3]:
        raise ValueError(f"the latent cache holds {cache.k.shape[3]} values a token (quant_policy="
                         f"{cache.quant_policy!r}), not the query's latent rank {rank} + the rotary {rope}: a cache "
                         f"allocated for another model's latent width")
    tokens, block_h, block_n, num_warps = _tiling(heads, rank, meta.is_decode)
    head_blocks = triton.cdiv(heads, block_h)
    if meta.is_decode:
        if num_splits is None:   # ~2 waves of programs, each split at least one tile
            want = triton.cdiv(2 * sm_count(q_lat.device), t * head_blocks)
            num_splits = max(1, min(want, triton.cdiv(meta.max_kv_len, block_n), 64))
        tokens_per_split = triton.cdiv(triton.cdiv(meta.max_kv_len, num_splits), block_n) * block_n
        num_splits = triton.cdiv(meta.max_kv_len, tokens_per_split)
    else:
        num_splits, tokens_per_split = 1, max(meta.max_kv_len, 1)
    split = num_splits > 1
    out = q_lat.new_empty(t, heads, rank)
    if split:
        part_out = torch.empty(t, heads, num_splits, rank, dtype=torch.float32, device=q_lat.device)
        part_lse = torch.empty(t, heads, num_splits, dtype=torch.float32, device=q_lat.device)
    else:   # stand-ins, never read
        part_out, part_lse = out, out
    values, qp, p_strides = _latent_args(cache)
    new = new_latent is not None and bool(cache.quant_policy)
    new_src = new_latent if new else q_lat
    new_strides = new_src.stride()[0], new_src.stride()[-1]
    dot_dtype, dot_prec = dot_args(q_lat.dtype)
    c_b, c_s, _, c_d = cache.k.stride()
    _mla_kernel[(meta.num_seqs, triton.cdiv(meta.max_q_len, tokens) * head_blocks, num_splits)](
        q_lat, q_rope, values, qp, new_src, meta.block_tables, meta.q_start_loc, meta.q_lens, meta.kv_lens,
        out, part_out, part_lse, softmax_scale * LOG2E, tokens_per_split,
        *q_lat.stride(), *q_rope.stride(), *meta.block_tables.stride(), *new_strides,
        c_b, c_s, c_d, p_strides[0], p_strides[1], p_strides[3], *out.stride(),
        *(part_out.stride()[:3] if split else (0, 0, 0)), *(part_lse.stride()[:2] if split else (0, 0)),
        HEADS=heads, RANK=rank, ROPE=rope, PAGE=cache.block_size, TOKENS=tokens, BLOCK_H=block_h,
        HEAD_BLOCKS=head_blocks, BLOCK_N=block_n, BLOCK_C=max(16, pow2(rank)), BLOCK_R=max(16, pow2(rope)),
        QUANT=kernel_quant(cache),
        ATT_DTYPE=tl_dtype(q_lat.dtype), DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec, NEW=new, SPLIT=split,
        num_warps=num_warps, num_stages=2,
    )
    if split:
        block_c = pow2(rank)
        _reduce_kernel[(t, heads)](
            part_out, part_lse, out, num_splits, part_lse,
            *part_out.stride()[:3], *part_lse.stride()[:2], *out.stride(),
            HEAD_DIM=rank, BLOCK_S=pow2(num_splits), BLOCK_D=block_c, SINKS=False,
            num_warps=4 if block_c >= 128 else 2,
        )
    return out
