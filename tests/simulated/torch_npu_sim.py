"""Simulated ``torch_npu``: the operators lmport's ascend backend calls, on CPU tensors.

Written from the torch_npu API documentation (Ascend/op-plugin, docs/context/):
- torch_npu-npu_scatter_nd_update_.md: ``npu_scatter_nd_update_(input, indices, updates)``;
- torch_npu-npu_fused_infer_attention_score.md: ``npu_fused_infer_attention_score(query, key,
  value, *, ...)``, the paged (block_table) and contiguous paths, rightDownCausal
  (sparse_mode=3) and per-token-per-head KV antiquant (key/value_antiquant_mode=3);
- torch_npu-npu_rotary_mul.md: ``npu_rotary_mul(input, r1, r2, rotary_mode='half')``;
- ``npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)`` (Ascend Extension for PyTorch
  API reference, ptaoplist "torch_npu.npu_rms_norm");
- ``torch.npu.mem_get_info`` / ``synchronize`` / ``is_available`` (here: ``npu``).

Antiquant follows Ascend's convention ANTIQUANT(x) = (x + offset) * scale
(torch_npu-npu_weight_quant_batchmatmul.md and the aclnn WeightQuantBatchMatmul pages).
Documented constraints raise RuntimeError; features the backend does not use and this
file does not model raise NotImplementedError.
"""
from __future__ import annotations

import math
import types

import psutil
import torch

__version__ = "simulated"

# (operator, summary of the call) for every simulated operator call, in order.
calls: list[tuple[str, dict]] = []

INT_MAX = 2147483647
_MASK_SIDE = 2048   # sparse_mode 2/3/4 take an "optimized" 2048 x 2048 lower-triangular mask


def _fail(message: str):
    raise RuntimeError(f"simulated torch_npu: {message}")


def _not_simulated(what: str):
    raise NotImplementedError(f"simulated torch_npu: {what} is not simulated")


# -- npu_scatter_nd_update_ ------------------------------------------------
_SCATTER_DTYPES = (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8)


def npu_scatter_nd_update_(input, indices, updates):
    """``input[indices[i]] = updates[i]`` in place; returns ``input``."""
    calls.append(("npu_scatter_nd_update_", {"dtype": input.dtype}))
    if input.dtype not in _SCATTER_DTYPES:
        _fail(f"npu_scatter_nd_update_: input dtype {input.dtype} is not one of {_SCATTER_DTYPES}")
    if updates.dtype != input.dtype:
        _fail(f"npu_scatter_nd_update_: updates dtype {updates.dtype} != input dtype {input.dtype}")
    if not 1 <= input.dim() <= 8:
        _fail(f"npu_scatter_nd_update_: input must have 1 to 8 dims, got {input.dim()}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() < 2:
        _fail(f"npu_scatter_nd_update_: indices must be int32/int64 with >= 2 dims, got {indices.dtype} "
              f"{tuple(indices.shape)}")
    depth = indices.shape[-1]
    if depth > input.dim():
        _fail(f"npu_scatter_nd_update_: indices' last dim {depth} exceeds input's {input.dim()} dims")
    expected = tuple(indices.shape[:-1]) + tuple(input.shape[depth:])
    if tuple(updates.shape) != expected:
        _fail(f"npu_scatter_nd_update_: updates shape {tuple(updates.shape)}, expected {expected}")
    rows = indices.reshape(-1, depth).long().tolist()
    for row in rows:
        if any(not 0 <= i < n for i, n in zip(row, input.shape)):
            _fail(f"npu_scatter_nd_update_: index {row} is out of range for shape {tuple(input.shape)}")
    for row, value in zip(rows, updates.reshape(-1, *input.shape[depth:])):
        input[tuple(row)] = value
    return input


# -- npu_fused_infer_attention_score ---------------------------------------
def _lengths(name: str, value, batch: int) -> list[int] | None:
    """SymInt[] per-batch lengths: one value for all batches, or at least ``batch`` values."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
        raise TypeError(f"simulated torch_npu: {name} must be a list of ints (SymInt[]), got {type(value).__name__}")
    if len(value) == 1:
        return list(value) * batch
    if len(value) < batch:
        _fail(f"{name} has {len(value)} entries for batch {batch}")
    return list(value[:batch])


def _check_causal_mask(mask) -> None:
    if mask is None:
        _fail("sparse_mode=3 needs the optimized atten_mask (2048, 2048)")
    if mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        _fail(f"atten_mask dtype must be bool/int8/uint8, got {mask.dtype}")
    if tuple(mask.shape[-2:]) != (_MASK_SIDE, _MASK_SIDE) or any(s != 1 for s in mask.shape[:-2]) or mask.dim() > 4:
        _fail(f"sparse_mode=3 needs atten_mask of shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), "
              f"got {tuple(mask.shape)}")
    upper = torch.ones(_MASK_SIDE, _MASK_SIDE, dtype=torch.bool).triu(1)
    if not torch.equal(mask.reshape(_MASK_SIDE, _MASK_SIDE).bool(), upper):
        _fail("sparse_mode=3 needs the lower-triangular mask: 1 (masked) strictly above the diagonal")


def npu_fused_infer_attention_score(
        query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
        actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
        quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None, block_table=None,
        query_padding_size=None, kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
        value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
        value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None, key_rope=None,
        key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX,
        input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
        antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0, value_antiquant_mode=0):
    """softmax(scale * Q K^T + mask) V; returns (attention_out, softmax_lse placeholder)."""
    unmodelled = {
        "pse_shift": pse_shift, "dequant_scale1": dequant_scale1, "quant_scale1": quant_scale1,
        "dequant_scale2": dequant_scale2, "quant_scale2": quant_scale2, "quant_offset2": quant_offset2,
        "antiquant_scale": antiquant_scale, "antiquant_offset": antiquant_offset,
        "query_padding_size": query_padding_size, "kv_padding_size": kv_padding_size,
        "key_shared_prefix": key_shared_prefix, "value_shared_prefix": value_shared_prefix,
        "actual_shared_prefix_len": actual_shared_prefix_len, "query_rope": query_rope, "key_rope": key_rope,
        "key_rope_antiquant_scale": key_rope_antiquant_scale}
    for name, arg in unmodelled.items():
        if arg is not None:
            _not_simulated(f"npu_fused_infer_attention_score({name}=...)")
    if softmax_lse_flag:
        _not_simulated("softmax_lse_flag=True")
    if input_layout not in ("BSH", "BSND"):
        _not_simulated(f"input_layout={input_layout!r}")

    # query
    if query.dtype not in (torch.float16, torch.bfloat16):
        _fail(f"query dtype must be float16 or bfloat16, got {query.dtype}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous (non-contiguous tensors are not supported)")
    kv_heads = num_key_value_heads or num_heads
    if num_heads % kv_heads or num_heads // kv_heads > 64:
        _fail(f"num_heads {num_heads} must be a multiple of num_key_value_heads {kv_heads}, ratio <= 64")
    if input_layout == "BSND":
        if query.dim() != 4 or query.shape[2] != num_heads:
            _fail(f"BSND query must be (B, S, {num_heads}, D), got {tuple(query.shape)}")
        q = query
    else:
        if query.dim() != 3 or query.shape[2] % num_heads:
            _fail(f"BSH query must be (B, S, H) with H divisible by num_heads, got {tuple(query.shape)}")
        q = query.view(query.shape[0], query.shape[1], num_heads, -1)
    batch, q_s, _, dim = q.shape
    if dim > 512:
        _fail(f"D must be <= 512, got {dim}")

    # key / value
    if key.shape != value.shape or key.dtype != value.dtype:
        _fail("key and value must have the same shape and dtype")
    if key.dtype == torch.int32:
        _not_simulated("int4 (int32-packed) key/value")
    if key.dtype not in (torch.float16, torch.bfloat16, torch.int8):
        _fail(f"key/value dtype must be float16, bfloat16 or int8, got {key.dtype}")
    quantized = key.dtype == torch.int8
    if not quantized and key.dtype != query.dtype:
        _fail(f"key/value dtype {key.dtype} must match the query's {query.dtype}")
    if q_s > 1 and dim % (32 if quantized else 16):
        _fail(f"when Q_S > 1, D must be {'32' if quantized else '16'}-aligned, got {dim}")
    kv_lens = _lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, batch)
    q_lens = _lengths("actual_seq_lengths", actual_seq_lengths, batch) if q_s > 1 else [1] * batch

    if block_table is not None:  # page attention
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
            _fail(f"block_table must be int32 (B={batch}, maxBlockNumPerSeq), got {block_table.dtype} "
                  f"{tuple(block_table.shape)}")
        if kv_lens is None:
            _fail("page attention needs actual_seq_lengths_kv")
        if key.dim() != 3:
            _fail("with a BSH/BSND query the paged KV cache must be (blocknum, blocksize, H)")
        if key.shape[1] != block_size or key.shape[2] != kv_heads * dim:
            _fail(f"paged KV cache {tuple(key.shape)} does not match block_size {block_size}, H {kv_heads * dim}")
        if q_s > 1:
            if quantized:
                _fail("page attention does not support antiquant (int8 key/value) when Q_S > 1")
            if block_size % 128 or not 128 <= block_size <= 512:
                _fail(f"page attention with Q_S > 1 needs block_size a multiple of 128 in [128, 512], "
                      f"got {block_size}")
        elif block_size % (32 if quantized else 16) or not 0 < block_size <= 512:
            _fail(f"page attention with Q_S = 1 needs block_size {'32' if quantized else '16'}-aligned "
                  f"and <= 512, got {block_size}")
        needed = max(math.ceil(n / block_size) for n in kv_lens)
        if block_table.shape[1] < needed:
            _fail(f"block_table has {block_table.shape[1]} columns, fewer than maxBlockNumPerSeq {needed}")
        if quantized:
            _not_simulated("antiquant with page attention (key_antiquant_mode 4/5)")
        ids = block_table[:, :needed].long()
        if ids.min() < 0 or ids.max() >= key.shape[0]:
            _fail("block_table names a block outside the cache")
        k = key[ids].reshape(batch, -1, kv_heads, dim)
        v = value[ids].reshape(batch, -1, kv_heads, dim)
    else:
        if input_layout == "BSND":
            if key.dim() != 4 or key.shape[2] != kv_heads or key.shape[3] != dim:
                _fail(f"BSND key must be (B, S, {kv_heads}, {dim}), got {tuple(key.shape)}")
            k, v = key, value
        else:
            if key.dim() != 3 or key.shape[2] != kv_heads * dim:
                _fail(f"BSH key must be (B, S, {kv_heads * dim}), got {tuple(key.shape)}")
            k, v = key.view(*key.shape[:2], kv_heads, dim), value.view(*value.shape[:2], kv_heads, dim)
        if k.shape[0] != batch:
            _fail(f"key batch {k.shape[0]} != query batch {batch}")
    kv_s = k.shape[1]
    kv_lens = kv_lens or [kv_s] * batch
    if max(kv_lens) > kv_s or max(q_lens) > q_s:
        _fail("an actual sequence length exceeds the tensor's S")

    k, v = k.float(), v.float()
    if quantized:
        if key_antiquant_scale is None or value_antiquant_scale is None:
            _fail("int8 key/value need key_antiquant_scale and value_antiquant_scale")
        if key_antiquant_mode != value_antiquant_mode:
            _fail("key_antiquant_mode and value_antiquant_mode must be equal")
        if q_s > 1 and key_antiquant_mode not in (0, 1):
            _fail(f"when Q_S > 1 only key_antiquant_mode 0 or 1 is supported, got {key_antiquant_mode}")
        if key_antiquant_mode != 3:
            _not_simulated(f"key_antiquant_mode={key_antiquant_mode}")
        # Mode 3, per token and per head: scale/offset (B, N, S), float32.
        for name, t in (("key_antiquant_scale", key_antiquant_scale), ("value_antiquant_scale", value_antiquant_scale),
                        ("key_antiquant_offset", key_antiquant_offset),
                        ("value_antiquant_offset", value_antiquant_offset)):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (batch, kv_heads, kv_s)):
                _fail(f"{name} must be float32 {(batch, kv_heads, kv_s)} in per-token-per-head mode, "
                      f"got {t.dtype} {tuple(t.shape)}")
        if (key_antiquant_offset is None) != (value_antiquant_offset is None):
            _fail("key_antiquant_offset and value_antiquant_offset must both be given or both be None")

        def antiquant(x, s, o):
            s, o = s.transpose(1, 2)[..., None], (0 if o is None else o.transpose(1, 2)[..., None])
            return (x + o) * s
        k = antiquant(k, key_antiquant_scale, key_antiquant_offset)
        v = antiquant(v, value_antiquant_scale, value_antiquant_offset)
    elif any(t is not None for t in (key_antiquant_scale, key_antiquant_offset,
                                       value_antiquant_scale, value_antiquant_offset)):
        _not_simulated("antiquant parameters with float key/value")

    # mask: only meaningful when Q_S > 1
    causal = False
    if q_s > 1:
        if sparse_mode == 3:
            _check_causal_mask(atten_mask)
            causal = True
        elif sparse_mode == 0:
            if atten_mask is not None:
                _not_simulated("a user atten_mask with sparse_mode=0")
        elif sparse_mode in (1, 2, 4):
            _not_simulated(f"sparse_mode={sparse_mode}")
        else:
            _fail(f"sparse_mode must be 0..4 when Q_S > 1, got {sparse_mode}")
    elif atten_mask is not None:
        _not_simulated("atten_mask with Q_S = 1")

    calls.append(("npu_fused_infer_attention_score", {
        "paged": block_table is not None, "q_s": q_s, "kv_dtype": key.dtype, "block_size": block_size,
        "key_antiquant_mode": key_antiquant_mode if quantized else None, "sparse_mode": sparse_mode}))

    group = num_heads // kv_heads
    out = torch.zeros(batch, q_s, num_heads, dim, dtype=torch.float32)
    for b in range(batch):
        lq, lk = q_lens[b], kv_lens[b]
        if lq == 0 or lk == 0:  # empty key/value: the output is zeros
            continue
        if causal and lq > lk:
            _fail(f"rightDownCausal needs actual_seq_lengths <= actual_seq_lengths_kv, got {lq} > {lk}")
        qb = q[b, :lq].float().transpose(0, 1)                            # [N, lq, D]
        kb = k[b, :lk].repeat_interleave(group, dim=1).transpose(0, 1)    # [N, lk, D]
        vb = v[b, :lk].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = scale * (qb @ kb.transpose(1, 2))                       # [N, lq, lk]
        if causal:  # rightDownCausal: query row i sees key columns <= i + (lk - lq)
            seen = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            scores = scores.masked_fill(~seen, float("-inf"))
        out[b, :lq] = (torch.softmax(scores, dim=-1) @ vb).transpose(0, 1)
    return out.to(query.dtype).view(query.shape), torch.zeros(1, dtype=torch.float32)


# -- npu_weight_quant_batchmatmul --------------------------------------------
def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    """y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias (torch_npu-npu_weight_quant_batchmatmul.md).

    x (m, k) float16/bfloat16; weight int8 (k, n), or int32 (k, n / 8) holding eight signed int4
    values along n (value j at bits 4j); antiquant_scale/offset in x's dtype, per channel (n,) /
    (1, n) or per group (ceil(k / antiquant_group_size), n); group size 0 or a multiple of 32 below k.
    """
    calls.append(("npu_weight_quant_batchmatmul", {"dtype": x.dtype, "weight": weight.dtype,
                                                   "group": antiquant_group_size}))
    if quant_scale is not None or quant_offset is not None:
        _not_simulated("quantized output (quant_scale / quant_offset)")
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2:
        _fail(f"npu_weight_quant_batchmatmul: x must be 2-d float16/bfloat16, got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    if weight.dtype == torch.int8:
        w = weight.to(torch.float32)
    elif weight.dtype == torch.int32:
        shifts = torch.arange(8, dtype=torch.int32) * 4
        nibbles = (weight[..., None] >> shifts) & 15
        w = torch.where(nibbles >= 8, nibbles - 16, nibbles).flatten(-2).to(torch.float32)
    else:
        _fail(f"npu_weight_quant_batchmatmul: weight must be int8 or int32 (packed int4), got {weight.dtype}")
    if w.shape[0] != k:
        _fail(f"npu_weight_quant_batchmatmul: weight has {w.shape[0]} rows, x has k={k}")
    n = w.shape[1]
    group = antiquant_group_size
    if group and (group % 32 or not 32 <= group < k):
        _fail(f"npu_weight_quant_batchmatmul: antiquant_group_size must be 0 or a multiple of 32 in [32, k), "
              f"got {group}")
    want = (-(-k // group), n) if group else None
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            _fail(f"npu_weight_quant_batchmatmul: {name} must be {x.dtype}, got {t.dtype}")
        if group and tuple(t.shape) != want or not group and t.numel() not in (1, n):
            _fail(f"npu_weight_quant_batchmatmul: {name} shape {tuple(t.shape)} does not fit group {group}, n={n}")
    def per_row(t):
        t = t.to(torch.float32)
        return t.repeat_interleave(group, dim=0)[:k] if group else t.reshape(1, -1)
    if antiquant_offset is not None:
        w = w + per_row(antiquant_offset)
    w = w * per_row(antiquant_scale)
    y = x.to(torch.float32) @ w
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


# -- npu_rms_norm ----------------------------------------------------------
def npu_rms_norm(self, gamma, epsilon=1e-06):
    """y = x / sqrt(mean(x^2) + eps) * gamma over gamma's dims; returns (y, rstd)."""
    x = self
    calls.append(("npu_rms_norm", {"dtype": x.dtype}))
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        _fail(f"npu_rms_norm: dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if gamma.dtype != x.dtype:
        _fail(f"npu_rms_norm: gamma dtype {gamma.dtype} must match the input's {x.dtype}")
    n = gamma.dim()
    if not 1 <= x.dim() <= 8 or n > x.dim() or tuple(x.shape[-n:]) != tuple(gamma.shape):
        _fail(f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must match the input's last dims {tuple(x.shape)}")
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=tuple(range(-n, 0)), keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


# -- npu_rotary_mul --------------------------------------------------------
def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """half mode: r1 * x + r2 * cat(-x2, x1); layout BSND with r1/r2 (1,S,1,D), (B,S,1,D) or (B,S,N,D)."""
    calls.append(("npu_rotary_mul", {"dtype": input.dtype}))
    if rotary_mode != "half":
        _not_simulated(f"rotary_mode={rotary_mode!r}")
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        if t.dim() != 4 or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            _fail(f"npu_rotary_mul: {name} must be a 4-D float16/bfloat16/float32 tensor, got {t.dtype} "
                  f"{tuple(t.shape)}")
        # Not stated on the page; the simulation assumes one dtype for all three, as the kernels use.
        if t.dtype != input.dtype:
            _fail(f"npu_rotary_mul: {name} dtype {t.dtype} differs from input's {input.dtype}")
    b, s, n, d = input.shape
    if d % 2 or d >= 896 or b >= 1000 or n >= 1000:
        _fail(f"npu_rotary_mul: needs D even and < 896, B and N < 1000, got {tuple(input.shape)}")
    if r1.shape != r2.shape or tuple(r1.shape) not in ((1, s, 1, d), (b, s, 1, d), (b, s, n, d)):
        _not_simulated(f"npu_rotary_mul with r1/r2 {tuple(r1.shape)} for input {tuple(input.shape)} (only BSND)")
    x = input.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (r1.float() * x + r2.float() * torch.cat((-x2, x1), dim=-1)).to(input.dtype)


# -- torch.npu -------------------------------------------------------------
# The simulated device's memory is host memory; there is no NPU, so is_available() is False.
npu = types.ModuleType("torch.npu", "simulated torch.npu (host memory, no device)")
npu.is_available = lambda: False
npu.device_count = lambda: 0
npu.synchronize = lambda device=None: None


def _mem_get_info(device=None):
    mem = psutil.virtual_memory()
    return mem.available, mem.total


npu.mem_get_info = _mem_get_info
