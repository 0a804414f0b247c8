"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, reference.

A "latent" layer (lmport.kv.layout.CacheKind) caches one vector a token: the compressed KV ``c`` (``kv_lora_rank``
values, after its RMSNorm) followed by the rotary key ``k_rope`` (``qk_rope_head_dim`` values, rotated), one "head"
shared by every query head. ``kv_b_proj`` ([H * (nope + v), rank]) expands ``c`` into each head's key part without
rotary (its first ``nope`` rows a head: W_k) and its value (the next ``v`` rows: W_v); a head's score is
``(q_nope . W_k c + q_rope . k_rope) * scale``.

- Prefill (a sequence with more than one new token, with or without history) expands its gathered latents into
  keys and values and attends over them, as transformers' forward does.
- Decode runs with the weights absorbed: ``q_nope W_k`` is a query in latent space, so the scores are
  ``[q_nope W_k, q_rope] . [c, k_rope]`` over the cached latents as they are (one KV head for all the query heads),
  the output is the weighted sum of the ``c``s, turned into each head's value through W_v; nothing of the length
  of the history is expanded.

A quantized cache (quant_policy 8 / 4, "fp8") keeps the latent as one head of codes per token (lmport.kv.quant);
the blocks read are dequantized as ``paged_attention`` dequantizes K and V, and, as there, the step's own latents
(``new_latent``) are attended to as they are, not through their quantized copies.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmport.kv.layout import LayerCache
from lmport.ops.attention import gather_kv
from lmport.ops.kv_fill import _write as write_paged
from lmport.ops.metadata import AttentionMetadata
from lmport.units import ceil_div


def _require_latent(cache: LayerCache, op: str) -> None:
    cache.require_axis_order("bshd", op)
    if cache.kind != "latent":
        raise ValueError(f"{op} reads a 'latent' cache (one latent a token), not a {cache.kind!r} one")


def fill_latent_cache(latent: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """latent [T, width] (``c`` then ``k_rope``); writes token t into slot ``slot_mapping[t]``, quantized when the
    cache is."""
    _require_latent(cache, "the reference fill_latent_cache")
    write_paged(cache.k, cache.k_qparams, cache.k_scale, latent[:, None, :], slot_mapping, cache.quant_policy)


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                  kv_b_weight: torch.Tensor, softmax_scale: float,
                  new_latent: torch.Tensor | None = None) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, rope] (rotated) -> [T, H, v]: causal attention of each new token over its
    sequence's cached latents (the new tokens' already written by ``fill_latent_cache``). ``kv_b_weight``
    [H * (nope + v), rank]: kv_b_proj's weight. Decoding sequences run as one batch, with the weights absorbed;
    each prefill (chunk) runs alone, expanded. ``new_latent``: the step's latents [T, width] as
    ``fill_latent_cache`` took them, read instead of their copies in a quantized cache."""
    _require_latent(cache, "the reference mla_attention")
    if meta.window is not None or meta.chunk is not None or meta.sinks is not None or meta.softcap is not None:
        raise ValueError("the reference mla_attention runs full causal attention: no window, chunk, sinks or soft cap")
    t, heads, nope = q_nope.shape
    v_dim = kv_b_weight.shape[0] // heads - nope
    q_lens = meta.q_lens_host or tuple(meta.q_lens.tolist())
    kv_lens = meta.kv_lens_host or tuple(meta.kv_lens.tolist())
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    out = q_nope.new_empty(t, heads, v_dim)
    if not cache.quant_policy:
        new_latent = None   # the cache holds the same values
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=q_nope.device)
        own = None if new_latent is None else new_latent[rows]
        out[rows] = _decode_absorbed(q_nope[rows], q_rope[rows], cache, meta, decodes, kv_lens, kv_b_weight,
                                     softmax_scale, own)
    for i in (i for i, n in enumerate(q_lens) if n > 1):
        s, e = starts[i], starts[i + 1]
        own = None if new_latent is None else new_latent[s:e]
        out[s:e] = _prefill_expanded(q_nope[s:e], q_rope[s:e], cache, meta, i, kv_lens[i], kv_b_weight,
                                     softmax_scale, own)
    return out


def _latents(cache: LayerCache, meta: AttentionMetadata, seqs: list[int], kv_len: int,
             dtype: torch.dtype) -> torch.Tensor:
    """The cached latents of sequences ``seqs`` [B, blocks * block_size, width] in ``dtype``, through the blocks
    holding their first ``kv_len`` tokens."""
    n_blocks = ceil_div(kv_len, meta.block_size)
    index = torch.tensor(seqs, device=meta.block_tables.device)
    tables = meta.block_tables.index_select(0, index)[:, :n_blocks].long()
    return gather_kv(cache.k, cache.k_qparams, tables, cache.quant_policy, dtype, cache.k_scale)[:, :, 0]


def _decode_absorbed(q_nope, q_rope, cache, meta, seqs, kv_lens, kv_b_weight, scale, own) -> torch.Tensor:
    """One new token a sequence [B, H, *]: attention in latent space (W_k absorbed into q, W_v applied after)."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = kv_b_weight.shape[1]
    w = kv_b_weight.view(heads, -1, rank)
    w_k, w_v = w[:, :nope], w[:, nope:]
    lens = [kv_lens[i] for i in seqs]
    latents = _latents(cache, meta, seqs, max(lens), q_nope.dtype)                 # [B, S, rank + rope]
    if own is not None:   # each sequence's new token sits at its last position
        latents[torch.arange(len(seqs), device=latents.device), torch.tensor(lens, device=latents.device) - 1] = \
            own.to(latents.dtype)
    q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_k), q_rope], dim=-1)     # [B, H, rank + rope]
    kv_pos = torch.arange(latents.shape[1], device=q.device)
    mask = kv_pos[None, :] < torch.tensor(lens, device=q.device)[:, None]          # [B, S]
    # One KV head shared by all the query heads (MQA over the latents); the values are the c's. Two batched
    # products: one query token a head needs nothing more (SDPA's general path costs several times as much here).
    scores = torch.einsum("bhw,bsw->bhs", q, latents).float() * scale
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(dim=-1).to(q.dtype)
    o = torch.einsum("bhs,bsr->bhr", probs, latents[..., :rank])
    return torch.einsum("bhr,hvr->bhv", o, w_v)


def _prefill_expanded(q_nope, q_rope, cache, meta, seq, kv_len, kv_b_weight, scale, own) -> torch.Tensor:
    """A sequence's new tokens [n, H, *] over its history and themselves: the latents expanded into each head's
    keys and values (kv_b_proj), then causal attention."""
    n, heads, nope = q_nope.shape
    rank = kv_b_weight.shape[1]
    latent = _latents(cache, meta, [seq], kv_len, q_nope.dtype)[0, :kv_len]       # [S, rank + rope]
    if own is not None:   # the new tokens are the last n positions
        latent[kv_len - n:] = own.to(latent.dtype)
    kv = F.linear(latent[:, :rank], kv_b_weight).view(kv_len, heads, -1)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k_rope = latent[:, None, rank:].expand(kv_len, heads, -1)
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)                         # [H, n, nope + rope]
    k = torch.cat([k_nope, k_rope], dim=-1).transpose(0, 1)
    q_pos = torch.arange(kv_len - n, kv_len, device=q.device)
    mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]       # [n, S]
    out = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
