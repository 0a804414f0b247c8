"""Paged attention over cached history plus new tokens (prefill, chunked prefill, decode).

The new tokens' K/V must already be in the cache (``fill_kv_cache`` runs
first). Only the blocks named in the block tables are gathered and, for a
quantized cache, dequantized: never a full-precision copy of the whole cache.

Over a quantized cache (INT8, INT4, fp8) the step's own keys and values, handed in as ``new_kv``, are attended
to as they are, not through their quantized copies: a prefill (chunk) sees itself in full precision and its
history through the cache, so the first generated token is the one an unquantized cache gives wherever the
history is empty. Every new token of a step (a decode token's own key too) is treated alike.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmport.kv import quant
from lmport.kv.layout import LayerCache
from lmport.ops.metadata import AttentionMetadata
from lmport.units import ceil_div


def gather_kv(values: torch.Tensor, qparams: torch.Tensor | None, tables: torch.Tensor,
              quant_policy: int | str, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[B, n_blocks] block ids -> [B, n_blocks * block_size, H, D] in ``dtype``; ``scale``: an fp8 cache's
    per-head scales."""
    flat = tables.flatten()  # index_select over one axis: much faster on CPU than 2-D advanced indexing
    if quant.is_fp8(quant_policy):   # as bytes: torch's index_select has no float8 kernel on the CPU
        x = quant.dequantize_fp8(values.view(torch.uint8).index_select(0, flat).view(values.dtype), scale, dtype)
    else:
        x = values.index_select(0, flat)
    if quant.has_codes(quant_policy):
        x = quant.dequantize(x, qparams.index_select(0, flat), quant_policy, dtype)
    return x.view(*tables.shape, *x.shape[1:]).flatten(1, 2).to(dtype)


def paged_attention(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                    softmax_scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]; causal over each sequence's absolute positions (and both ways within each
    of ``meta.bidirectional``'s spans), within ``meta.window`` positions when the layer has a sliding window and
    within the token's own chunk when it has ``meta.chunk``, scores soft-capped by ``meta.softcap`` when it has
    one, each head's ``meta.sinks`` logit in the softmax's denominator when it has sinks.

    Decoding sequences run as one batch; each prefill (chunk) runs alone, so a
    long chunk never pads every decode row to its length.

    ``new_kv``: the step's keys and values [T, Hkv, D] as ``fill_kv_cache`` took them; over a quantized cache
    the step's tokens attend to these instead of their quantized copies (an unquantized cache holds the same
    values, and is read as it is).
    """
    if not cache.quant_policy:
        new_kv = None
    cache.require_axis_order("bshd", "the reference paged_attention")
    q_lens = meta.q_lens_host or tuple(meta.q_lens.tolist())
    kv_lens = meta.kv_lens_host or tuple(meta.kv_lens.tolist())
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    groups = ([decodes] if decodes else []) + [[i] for i, n in enumerate(q_lens) if n > 1]
    if len(groups) == 1:
        return _attend(q, cache, meta, softmax_scale, groups[0], q_lens, kv_lens, starts, new_kv)
    out = torch.empty_like(q)
    for seqs in groups:
        rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])], device=q.device)
        out[rows] = _attend(q, cache, meta, softmax_scale, seqs, q_lens, kv_lens, starts, new_kv)
    return out


def _attend(q, cache, meta, softmax_scale, seqs, q_lens, kv_lens, starts, new_kv) -> torch.Tensor:
    """Attention for the sequences ``seqs``, padded to their longest q and kv; returns their q rows in order."""
    dev = q.device
    max_q = max(q_lens[i] for i in seqs)
    n_blocks = ceil_div(max(kv_lens[i] for i in seqs), meta.block_size)
    index = torch.tensor(seqs, device=dev)
    tables = meta.block_tables.index_select(0, index)[:, :n_blocks].long()
    k = gather_kv(cache.k, cache.k_qparams, tables, cache.quant_policy, q.dtype, cache.k_scale)
    v = gather_kv(cache.v, cache.v_qparams, tables, cache.quant_policy, q.dtype, cache.v_scale)

    steps = torch.arange(max_q, device=dev)
    sub_q_lens = torch.tensor([q_lens[i] for i in seqs], device=dev)
    first_pos = torch.tensor([kv_lens[i] - q_lens[i] for i in seqs], device=dev)
    rows = (torch.tensor([starts[i] for i in seqs], device=dev)[:, None] + steps).clamp_(max=q.shape[0] - 1)
    valid = steps < sub_q_lens[:, None]
    q_pos = first_pos[:, None] + steps
    if new_kv is not None:   # the step's own tokens as they are: rows[valid] of new_kv sit at q_pos[valid]
        seq = torch.arange(len(seqs), device=dev)[:, None].expand_as(q_pos)[valid]
        k[seq, q_pos[valid]] = new_kv[0][rows[valid]].to(k.dtype)
        v[seq, q_pos[valid]] = new_kv[1][rows[valid]].to(v.dtype)
    kv_pos = torch.arange(k.shape[1], device=dev)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]          # [B, max_q, max_kv]; padded rows are dropped
    if meta.bidirectional is not None:   # or-ed with causal before the window and chunk narrow it
        mask |= _same_span(meta.bidirectional, seqs, kv_lens, q_pos, kv_pos)
    if meta.window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - meta.window
    if meta.chunk is not None:
        mask &= kv_pos[None, None, :] // meta.chunk == q_pos[:, :, None] // meta.chunk

    if meta.sinks is not None:
        out = _attention_with_sinks(q[rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None],
                                    softmax_scale, meta.softcap, meta.sinks)
    elif meta.softcap is not None:
        out = _softcapped_attention(q[rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None],
                                    softmax_scale, meta.softcap)
    else:
        out = F.scaled_dot_product_attention(
            q[rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None], scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)[valid]


def _same_span(spans, seqs, kv_lens, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """[B, max_q, max_kv]: whether the query and the key sit in one of their sequence's bidirectional spans (keys
    past the sequence's cached tokens never)."""
    q_span = torch.full_like(q_pos, -1)
    kv_span = torch.full((len(seqs), kv_pos.shape[0]), -1, dtype=q_pos.dtype, device=q_pos.device)
    for row, i in enumerate(seqs):
        for k, (start, end) in enumerate(spans[i]):
            end = min(end, kv_lens[i])
            q_span[row][(q_pos[row] >= start) & (q_pos[row] < end)] = k
            kv_span[row, start:end] = k
    return (q_span[:, :, None] == kv_span[:, None, :]) & (q_span[:, :, None] >= 0)


def _softcapped_attention(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """softmax(softcap * tanh(scale * q k^T / softcap), masked) v over [B, H, S, D] (GQA by repeat), the
    order transformers' Gemma computes it in; scaled_dot_product_attention has no soft cap."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return scores @ v


def _attention_with_sinks(q, k, v, mask, scale: float, softcap: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] with the sink's column dropped, times v, over [B, H, S, D] (GQA by repeat):
    the order transformers' gpt-oss computes it in (the row's maximum subtracted first)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    combined = torch.cat([scores, sink], dim=-1)
    probs = (combined - combined.amax(dim=-1, keepdim=True)).softmax(-1)[..., :-1]
    return probs.to(v.dtype) @ v
