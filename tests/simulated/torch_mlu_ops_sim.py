"""Simulated ``torch_mlu_ops``: the Cambricon operators lmport's camb backend calls, on CPU tensors.

Written from the docstrings of Torch-MLU-Ops' Python API (torch_mlu_ops/_ops.py:
"Math", "Args" and "Type(s)" of each operator) and its use in Cambricon/vllm-mlu
(vllm_mlu/attention/backends/flash_attn.py) and DeepLink-org/dlinfer
(dlinfer/vendor/camb/camb_ops.py):
- ``reshape_paged_cache(k, v, k_cache, v_cache, slot_mapping, direction=False)``:
  ``k_cache[slot // block_size, :, slot % block_size, :] = k[i]`` for slots >= 0,
  caches (block_num, head_num_kv, block_size, head_size), slot_mapping int32;
- ``single_query_cached_kv_attn(q, k_cache, v_cache, out, block_tables, context_lens,
  k_cache_quant_scale, v_cache_quant_scale, alibi_slopes, max_context_len,
  windows_size_left, windows_size_right, softmax_scale, ...)``: q (batch, seq_q, Hq, D),
  paged block_size one of 1..64 (powers of two), int32 tables and lengths;
- ``flash_attention(q, k, v, out, cu_seq_lens_q, cu_seq_lens_kv, alibi_slope, attn_bias,
  max_seq_len_q, max_seq_len_kv, softmax_scale, is_causal, ..., block_tables=None, ...)``:
  packed q (total_q, Hq, D); paged k/v (total_blocks, Hkv, block_size, D), "block_size only
  support 16"; the causal mask is aligned to the bottom right (the last query row sees the
  whole key range), which is how vLLM-MLU and LMDeploy use it for prefill over cached history;
- ``fused_rms_norm(x, residual, gamma, beta, bias, eps, store_output_before_norm, ...)``.

Documented constraints raise RuntimeError; arguments the backend does not use and this
file does not model raise NotImplementedError.
"""
from __future__ import annotations

import torch

calls: list[tuple[str, dict]] = []

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _fail(message: str):
    raise RuntimeError(f"simulated torch_mlu_ops: {message}")


def _not_simulated(what: str):
    raise NotImplementedError(f"simulated torch_mlu_ops: {what} is not simulated")


def _check_int32(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dtype != torch.int32 or t.dim() != dims:
        _fail(f"{name} must be a {dims}-D int32 tensor, got {t.dtype} {tuple(t.shape)}")


def reshape_paged_cache(k, v, k_cache, v_cache, slot_mapping, direction=False):
    """Scatter each token's K/V into its slot of the paged caches (direction=False)."""
    calls.append(("reshape_paged_cache", {"dtype": k_cache.dtype}))
    if direction:
        _not_simulated("reshape_paged_cache(direction=True)")
    if v is None or v_cache is None:
        _not_simulated("reshape_paged_cache without v / v_cache")
    if k.dim() != 3 or v.shape != k.shape:
        _fail(f"k and v must be (num_token, head_num_kv, head_size), got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        _fail(f"k_cache and v_cache must be (block_num, head_num_kv, block_size, head_size), "
              f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    blocks, heads, block_size, head_size = k_cache.shape
    if (k.shape[1], k.shape[2]) != (heads, head_size):
        _fail(f"k {tuple(k.shape)} does not match the cache's heads {heads} and head_size {head_size}")
    for t in (k, v, k_cache, v_cache):
        if t.dtype not in _FLOATS + (torch.int8,) or t.dtype != k_cache.dtype:
            _fail(f"k, v and the caches must share one of float, half, bfloat16, int8; got {t.dtype}")
    _check_int32("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != k.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        if slot >= blocks * block_size:
            _fail(f"slot {slot} is outside the cache ({blocks} blocks x {block_size})")
        k_cache[slot // block_size, :, slot % block_size, :] = k[i]
        v_cache[slot // block_size, :, slot % block_size, :] = v[i]
    return k_cache, v_cache


def _attend(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """q [lq, Hq, D], k/v [lk, Hkv, D] -> [lq, Hq, D] in float32; causal aligned to the bottom right."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = scale * (qf @ kf.transpose(1, 2))
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        seen = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(~seen, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).transpose(0, 1)


def _collect(cache, table, length: int) -> torch.Tensor:
    """The first ``length`` tokens of a paged sequence: (total_blocks, H, bs, D) -> (length, H, D)."""
    bs = cache.shape[2]
    n = -(-length // bs)
    ids = table[:n].long()
    if n > table.shape[0] or (n and (ids.min() < 0 or ids.max() >= cache.shape[0])):
        _fail("a block table names too few blocks or a block outside the cache")
    return cache[ids].permute(0, 2, 1, 3).reshape(n * bs, cache.shape[1], cache.shape[3])[:length]


def _check_heads(q_heads: int, kv_heads: int) -> None:
    if q_heads % kv_heads:
        _fail(f"head_num_q {q_heads} must be a multiple of head_num_kv {kv_heads}")


def single_query_cached_kv_attn(q, k_cache, v_cache, out, block_tables, context_lens, k_cache_quant_scale,
                                v_cache_quant_scale, alibi_slopes, max_context_len, windows_size_left,
                                windows_size_right, softmax_scale, return_lse=False, kv_cache_quant_bit_size=-1,
                                q_quant_scale=None, out_quant_scale=None, out_dtype=torch.half,
                                compute_dtype=torch.float, head_size_v=-1, mask=None, cu_seq_q=None,
                                max_seq_q=-1, sink=None):
    """Decode attention of one query token per sequence over its paged K/V."""
    calls.append(("single_query_cached_kv_attn", {"dtype": q.dtype, "block_size": k_cache.shape[2]}))
    for name, arg in (("k_cache_quant_scale", k_cache_quant_scale), ("v_cache_quant_scale", v_cache_quant_scale),
                      ("alibi_slopes", alibi_slopes), ("q_quant_scale", q_quant_scale),
                      ("out_quant_scale", out_quant_scale), ("mask", mask), ("cu_seq_q", cu_seq_q),
                      ("sink", sink), ("v_cache=None", None if v_cache is not None else True)):
        if arg is not None:
            _not_simulated(f"single_query_cached_kv_attn({name})")
    if return_lse or kv_cache_quant_bit_size != -1 or windows_size_left != -1 or windows_size_right != -1:
        _not_simulated("lse output, quantized caches or sliding windows")
    if q.dim() != 4 or q.shape[1] != 1:
        _not_simulated(f"q of shape {tuple(q.shape)} (only (batch, 1, head_num_q, head_size))")
    if q.dtype not in _FLOATS or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        _fail(f"q and the caches must share one of float, half, bfloat16; got {q.dtype}, {k_cache.dtype}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != q.shape[3]:
        _fail(f"caches must be (total_blocks, head_num_kv, block_size, {q.shape[3]}), got {tuple(k_cache.shape)}")
    if k_cache.shape[2] not in (1, 2, 4, 8, 16, 32, 64):
        _fail(f"paged block_size must be one of 1, 2, 4, 8, 16, 32, 64, got {k_cache.shape[2]}")
    _check_heads(q.shape[2], k_cache.shape[1])
    batch = q.shape[0]
    _check_int32("block_tables", block_tables, 2)
    _check_int32("context_lens", context_lens, 1)
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        _fail(f"block_tables and context_lens need {batch} rows")
    lens = context_lens.tolist()
    if 0 < max_context_len < max(lens):  # the docs: "correctness is not guaranteed"
        _fail(f"max_context_len {max_context_len} < the longest context {max(lens)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        _fail(f"out must match q {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    for b, length in enumerate(lens):
        k = _collect(k_cache, block_tables[b], length)
        v = _collect(v_cache, block_tables[b], length)
        out[b] = _attend(q[b], k, v, softmax_scale, causal=False).to(out.dtype)
    return out


def flash_attention(q, k, v, out, cu_seq_lens_q, cu_seq_lens_kv, alibi_slope, attn_bias, max_seq_len_q,
                    max_seq_len_kv, softmax_scale, is_causal, window_size_left=-1, window_size_right=-1,
                    compute_dtype=torch.float, return_lse=False, block_tables=None, k_quant_scale=None,
                    v_quant_scale=None, q_quant_scale=None, out_quant_scale=None, out_dtype=torch.half,
                    q2k_block_idx=None, q2k_block_num=None, variable_block_sizes=None, q_block_size=256,
                    k_block_size=128, sink=None):
    """Variable-length attention of packed queries over packed or paged K/V."""
    calls.append(("flash_attention", {"dtype": q.dtype, "paged": block_tables is not None}))
    for name, arg in (("alibi_slope", alibi_slope), ("attn_bias", attn_bias), ("k_quant_scale", k_quant_scale),
                      ("v_quant_scale", v_quant_scale), ("q_quant_scale", q_quant_scale),
                      ("out_quant_scale", out_quant_scale), ("q2k_block_idx", q2k_block_idx),
                      ("q2k_block_num", q2k_block_num), ("variable_block_sizes", variable_block_sizes),
                      ("sink", sink)):
        if arg is not None:
            _not_simulated(f"flash_attention({name})")
    if return_lse or window_size_left != -1 or window_size_right != -1:
        _not_simulated("lse output or sliding windows")
    if q.dim() != 3:
        _not_simulated(f"q of shape {tuple(q.shape)} (only packed (total_seq_q, head_num_q, head_size))")
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"q, k and v must share one of float, half, bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if compute_dtype not in (torch.half, torch.float, torch.bfloat16):
        _fail(f"compute_dtype must be half, float or bfloat16, got {compute_dtype}")
    _check_int32("cu_seq_lens_q", cu_seq_lens_q, 1)
    _check_int32("cu_seq_lens_kv", cu_seq_lens_kv, 1)
    batch = cu_seq_lens_q.shape[0] - 1
    if cu_seq_lens_kv.shape[0] != batch + 1:
        _fail("cu_seq_lens_q and cu_seq_lens_kv need batch + 1 entries each")
    cq, ckv = cu_seq_lens_q.tolist(), cu_seq_lens_kv.tolist()
    if cq[0] != 0 or cq[-1] != q.shape[0]:
        _fail(f"cu_seq_lens_q must run from 0 to total_seq_q {q.shape[0]}, got {cq}")
    q_lens = [b - a for a, b in zip(cq, cq[1:])]
    kv_lens = [b - a for a, b in zip(ckv, ckv[1:])]
    if max(q_lens) > max_seq_len_q or max(kv_lens) > max_seq_len_kv:
        _fail(f"max_seq_len_q/kv ({max_seq_len_q}, {max_seq_len_kv}) below the actual maxima "
              f"({max(q_lens)}, {max(kv_lens)})")
    if block_tables is not None:
        if k.dim() != 4 or v.shape != k.shape or k.shape[3] != q.shape[2]:
            _fail(f"paged k/v must be (total_blocks, head_num_kv, block_size, {q.shape[2]}), got {tuple(k.shape)}")
        if k.shape[2] != 16:
            _fail(f"paged flash_attention supports block_size 16 only, got {k.shape[2]}")
        _check_int32("block_tables", block_tables, 2)
        if block_tables.shape[0] != batch:
            _fail(f"block_tables needs {batch} rows")
    elif k.dim() != 3 or v.shape != k.shape or ckv[-1] != k.shape[0]:
        _fail(f"packed k/v must be (total_seq_kv={ckv[-1]}, head_num_kv, head_size), got {tuple(k.shape)}")
    _check_heads(q.shape[1], k.shape[1])
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != v.dtype:
        _fail(f"out must be {tuple(q.shape)} {v.dtype}, got {tuple(out.shape)} {out.dtype}")
    for b in range(batch):
        if block_tables is not None:
            kb, vb = _collect(k, block_tables[b], kv_lens[b]), _collect(v, block_tables[b], kv_lens[b])
        else:
            kb, vb = k[ckv[b]:ckv[b + 1]], v[ckv[b]:ckv[b + 1]]
        if is_causal and q_lens[b] > kv_lens[b]:
            _fail(f"causal attention with more queries ({q_lens[b]}) than keys ({kv_lens[b]})")
        out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], kb, vb, softmax_scale, is_causal).to(out.dtype)
    return out


def fused_rms_norm(x, residual, gamma, beta, bias, eps, store_output_before_norm, quant_scale=None, out=None,
                   dynamic_quant=False, store_output_after_norm=False, quant_type=torch.int8,
                   scale_type=torch.float, mx_quant=False):
    """rmsnorm(x) * gamma over the last dim, in x's dtype (no residual, bias or quantization here)."""
    calls.append(("fused_rms_norm", {"dtype": x.dtype}))
    for name, arg in (("residual", residual), ("beta", beta), ("bias", bias), ("quant_scale", quant_scale)):
        if arg is not None:
            _not_simulated(f"fused_rms_norm({name})")
    if store_output_before_norm or dynamic_quant or store_output_after_norm or mx_quant:
        _not_simulated("fused_rms_norm extra outputs or quantization")
    if x.dtype not in _FLOATS or gamma is None or gamma.dtype != x.dtype or tuple(gamma.shape) != (x.shape[-1],):
        _fail(f"x must be float/half/bfloat16 and gamma ({x.shape[-1]},) of the same dtype; got {x.dtype}, "
              f"{None if gamma is None else (gamma.dtype, tuple(gamma.shape))}")
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
