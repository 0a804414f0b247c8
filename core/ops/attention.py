"""Paged attention over cached history plus new tokens (prefill, chunked prefill, decode).

The new tokens' K/V must already be in the cache (``fill_kv_cache`` runs
first). Only the blocks named in the block tables are gathered and, for a
quantized cache, dequantized: never a full-precision copy of the whole cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmport.kv import quant
from lmport.kv.layout import LayerCache
from lmport.ops.metadata import AttentionMetadata


def gather_kv(values: torch.Tensor, qparams: torch.Tensor | None, tables: torch.Tensor,
              quant_policy: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, n_blocks] block ids -> [B, n_blocks * block_size, H, D] in ``dtype``."""
    flat = tables.flatten()  # index_select over one axis: much faster on CPU than 2-D advanced indexing
    x = values.index_select(0, flat)
    if quant_policy:
        x = quant.dequantize(x, qparams.index_select(0, flat), quant_policy, dtype)
    return x.view(*tables.shape, *x.shape[1:]).flatten(1, 2).to(dtype)


def paged_attention(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                    softmax_scale: float) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]; causal over each sequence's absolute positions."""
    n_blocks = -(-meta.max_kv_len // meta.block_size)
    tables = meta.block_tables[:, :n_blocks].long()
    k = gather_kv(cache.k, cache.k_qparams, tables, cache.quant_policy, q.dtype)
    v = gather_kv(cache.v, cache.v_qparams, tables, cache.quant_policy, q.dtype)

    # Pad the new tokens to [B, max_q_len]; padded rows are computed and dropped.
    steps = torch.arange(meta.max_q_len, device=q.device)
    rows = (meta.q_start_loc[:-1, None].long() + steps).clamp_(max=q.shape[0] - 1)
    valid = steps < meta.q_lens[:, None]
    q_pos = (meta.kv_lens - meta.q_lens)[:, None].long() + steps
    kv_pos = torch.arange(k.shape[1], device=q.device)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]          # [B, max_q, max_kv]

    out = F.scaled_dot_product_attention(
        q[rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)[valid]
