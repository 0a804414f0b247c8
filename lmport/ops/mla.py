"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, reference.

A "latent" layer (lmport.kv.layout.CacheKind) caches one vector a token: the compressed KV ``c`` (``kv_lora_rank``
values, after its RMSNorm) followed by the rotary key ``k_rope`` (``qk_rope_head_dim`` values, rotated), one "head"
shared by every query head. transformers' ``kv_b_proj`` expands ``c`` into each head's key part without rotary
(W_k, [nope, rank] a head) and its value (W_v, [v, rank] a head); a head's score is
``(q_nope . W_k c + q_rope . k_rope) * scale``.

lmport attends with the projections absorbed, as llama.cpp and the cuda kernel do, for prefill and decode alike:
``q_nope W_k`` is a query in latent space (``head_linear`` over ``k_b_proj``, each head's W_k transposed:
[rank, nope] a head, as llama.cpp's converter writes ``attn_k_b``), so the scores are
``[q_nope W_k, q_rope] . [c, k_rope]`` over the cached latents as they are (multi-query attention with one KV head
whose value is ``c``); ``latent_attention`` returns each head's weighted sum of ``c``s, and ``head_linear`` over
``v_b_proj`` (W_v, ``attn_v_b``) turns it into the head's value. Nothing of the length of the history is
expanded, and the two per-head projections stay in their checkpoint's format (a GGUF's quantized blocks).

A quantized cache (quant_policy 8 / 4, "fp8") keeps the latent as one head of codes per token (lmport.kv.quant);
the blocks read are dequantized as ``paged_attention`` dequantizes K and V, and, as there, the step's own latents
(``new_latent``) are attended to as they are, not through their quantized copies.
"""
from __future__ import annotations

import torch

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


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H, in] -> [T, H, out]: head h's inputs through its own rows [h * out, (h + 1) * out) of the float
    ``weight`` [H * out, in] (MLA's absorbed projections)."""
    heads = x.shape[1]
    return torch.einsum("thi,hoi->tho", x, weight.view(heads, -1, weight.shape[1]))


def latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                     softmax_scale: float, new_latent: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat [T, H, rank] (q_nope W_k), q_rope [T, H, rope] (rotated) -> [T, H, rank]: each new token's
    softmax-weighted sum of its sequence's cached ``c``s, causal, a head at a time (the new tokens' latents already
    written by ``fill_latent_cache``). Decoding sequences run as one batch, each prefill (chunk) alone.
    ``new_latent``: the step's latents [T, width] as ``fill_latent_cache`` took them, read instead of their copies
    in a quantized cache."""
    _require_latent(cache, "the reference latent_attention")
    if meta.window is not None or meta.chunk is not None or meta.sinks is not None or meta.softcap is not None:
        raise ValueError("the reference latent_attention runs full causal attention: no window, chunk, sinks or "
                         "soft cap")
    rank = q_lat.shape[2]
    q = torch.cat([q_lat, q_rope], dim=-1)                                       # [T, H, rank + rope]
    q_lens = meta.q_lens_host or tuple(meta.q_lens.tolist())
    kv_lens = meta.kv_lens_host or tuple(meta.kv_lens.tolist())
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    out = q.new_empty(q.shape[0], q.shape[1], rank)
    if not cache.quant_policy:
        new_latent = None   # the cache holds the same values
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=q.device)
        own = None if new_latent is None else new_latent[rows]
        out[rows] = _decode(q[rows], cache, meta, decodes, kv_lens, rank, softmax_scale, own)
    for i in (i for i, n in enumerate(q_lens) if n > 1):
        s, e = starts[i], starts[i + 1]
        own = None if new_latent is None else new_latent[s:e]
        out[s:e] = _prefill(q[s:e], cache, meta, i, kv_lens[i], rank, softmax_scale, own)
    return out


def _latents(cache: LayerCache, meta: AttentionMetadata, seqs: list[int], kv_len: int,
             dtype: torch.dtype) -> torch.Tensor:
    """The cached latents of sequences ``seqs`` [B, blocks * block_size, width] in ``dtype``, through the blocks
    holding their first ``kv_len`` tokens."""
    n_blocks = ceil_div(kv_len, meta.block_size)
    index = torch.tensor(seqs, device=meta.block_tables.device)
    tables = meta.block_tables.index_select(0, index)[:, :n_blocks].long()
    return gather_kv(cache.k, cache.k_qparams, tables, cache.quant_policy, dtype, cache.k_scale)[:, :, 0]


def _decode(q, cache, meta, seqs, kv_lens, rank, scale, own) -> torch.Tensor:
    """One new token a sequence, q [B, H, rank + rope] -> [B, H, rank]."""
    lens = [kv_lens[i] for i in seqs]
    latents = _latents(cache, meta, seqs, max(lens), q.dtype)                      # [B, S, rank + rope]
    if own is not None:   # each sequence's new token sits at its last position
        latents[torch.arange(len(seqs), device=latents.device), torch.tensor(lens, device=latents.device) - 1] = \
            own.to(latents.dtype)
    kv_pos = torch.arange(latents.shape[1], device=q.device)
    mask = kv_pos[None, :] < torch.tensor(lens, device=q.device)[:, None]          # [B, S]
    return _attend(q, latents, mask, rank, scale)


# Scores a prefill computes at once (float32 values): its new tokens go in runs that keep [rows, H, S] within it.
PREFILL_SCORES = 1 << 24


def _prefill(q, cache, meta, seq, kv_len, rank, scale, own) -> torch.Tensor:
    """A sequence's new tokens q [n, H, rank + rope] over its history and themselves -> [n, H, rank], a run of
    tokens at a time."""
    n, heads = q.shape[0], q.shape[1]
    latent = _latents(cache, meta, [seq], kv_len, q.dtype)[0, :kv_len]           # [S, rank + rope]
    if own is not None:   # the new tokens are the last n positions
        latent[kv_len - n:] = own.to(latent.dtype)
    kv_pos = torch.arange(kv_len, device=q.device)
    out = q.new_empty(n, heads, rank)
    run = max(1, PREFILL_SCORES // (heads * kv_len))
    for s in range(0, n, run):
        e = min(n, s + run)
        mask = kv_pos[None, :] <= kv_pos[kv_len - n + s:kv_len - n + e, None]      # [rows, S]
        out[s:e] = _attend(q[s:e], latent, mask, rank, scale)
    return out


def _attend(q, latents, mask, rank, scale) -> torch.Tensor:
    """q [N, H, rank + rope] over ``latents`` ([N, S, rank + rope], a row's own, or [S, rank + rope] shared by the
    rows) where ``mask`` [N, S] allows -> [N, H, rank]. One KV head shared by all the query heads, whose values are
    the c's: two batched products and a float32 softmax (SDPA's general and masked paths cost more here)."""
    scores = torch.matmul(q, latents.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, latents[..., :rank])
