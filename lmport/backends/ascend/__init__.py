"""ascend backend: Huawei Ascend NPUs through torch_npu.

Which torch_npu operator each op runs on, and where its signature, layouts and
dtypes were checked (torch_npu API docs in Ascend/op-plugin, docs/context/, and
the Ascend Extension for PyTorch API reference on hiascend.com):

- fill_kv_cache: ``torch_npu.npu_scatter_nd_update_(input, indices, updates)``
  (torch_npu-npu_scatter_nd_update_.md) on the cache viewed as [blocks * slots,
  heads, dim], indices = slot_mapping[:, None]. Quantized caches: the codes and
  (scale, zero) come from lmport's scheme (``lmport.kv.quant``), so the bytes are
  the same on every backend; the op has no uint8, so the uint8 codes are written
  through an int8 view (same bytes).
- paged_attention: ``torch_npu.npu_fused_infer_attention_score`` (FIA,
  torch_npu-npu_fused_infer_attention_score.md), query laid out "BSND":
  * decode, unquantized: page attention on the cache itself, viewed as
    (blocknum, blocksize, H) with block_table / block_size / actual_seq_lengths_kv
    (documented for Q_S = 1 with block sizes 16-aligned and <= 512);
  * decode, INT8: FIA's per-token-per-head antiquant (key/value_antiquant_mode=3,
    scale and offset float32 (B, N, S)). The op wants signed int8 and computes
    (x + offset) * scale (Ascend's ANTIQUANT convention, see
    torch_npu-npu_weight_quant_batchmatmul.md); our codes are unsigned with
    x = (q - zero) * scale, so the blocks named in the block tables are gathered,
    re-centred (q ^ 0x80 == q - 128 as int8) and passed with offset = 128 - zero,
    i.e. offset = -zero in the signed domain. The op's page-attention antiquant
    modes (4, 5) want float32 scales in their own layout, not ours beside the block,
    hence the gather;
  * prefill (any sequence with more than one new token), unquantized, block size a
    multiple of 128 up to 512 (the documented page-attention limits for Q_S > 1):
    page attention with sparse_mode=3 (rightDownCausal, the 2048 x 2048 mask the
    page asks for) and actual_seq_lengths / actual_seq_lengths_kv per sequence;
  * fallback, stated: INT4 (FIA's int4 is int32-packed in an order the pages call
    "interleaved" without defining it, and page attention refuses int4 with a
    float query), INT8 prefill (antiquant with Q_S > 1 is per-channel or per-token
    only, not per-token-per-head) and block sizes page attention refuses (prefill
    below 128 or not a multiple of 128, anything above 512): the blocks named in the
    block tables are gathered and dequantized with the reference
    (``lmport.ops.gather_kv``) and FIA runs on the contiguous result.
  * queries FIA does not take (float32, head_dim not 16-aligned or > 512, more than
    64 query heads per KV head) use the reference op.
  * soft-capped layers (``meta.softcap``, Gemma 2) use the reference op: FIA has no soft cap.
  * sliding-window layers (``meta.window``) use the reference op, stated fallback: FIA's
    band mode (sparse_mode=4 with pre_tokens / next_tokens) is the documented way to
    express a window, but the simulated module does not model it, so a call through it
    could not be checked here.
- quant_linear (int4 / int8 weights, docs/weight-quantization.md):
  ``torch_npu.npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset, bias=...,
  antiquant_group_size=group)`` (torch_npu-npu_weight_quant_batchmatmul.md), which computes
  x @ ((weight + offset) * scale): our w = scale * q + min becomes offset = min / scale (8-bit,
  signed codes as they are) or 8 + min / scale (4-bit, codes re-centred to signed q - 8 and packed
  eight to an int32 along the outputs, the op's int4 layout); scale and offset per group as
  (in / group, out) in x's dtype. The int4 repack runs per call (not yet cached at load).
  float32 activations (the op takes float16 / bfloat16) use the reference.
- rms_norm: ``torch_npu.npu_rms_norm(x, gamma, epsilon)[0]`` (ptaoplist
  "torch_npu.npu_rms_norm": float16/bfloat16/float32, gamma in x's dtype).
- apply_rotary: ``torch_npu.npu_rotary_mul(x, r1, r2)`` in "half" mode
  (torch_npu-npu_rotary_mul.md), x as BSND [1, T, H, D], r1/r2 = cos/sin as
  (1, T, 1, D); the page states r1/r2 in [-1, 1], which cos/sin scaled by a rope
  attention factor above 1 can leave (accuracy, not a hard limit).
- memory_info / synchronize: ``torch.npu.mem_get_info`` / ``torch.npu.synchronize``.
- copy_blocks: the reference (index_select / index_copy_ run as torch ops on the NPU).

FIA takes its sequence lengths as host int lists (SymInt[]), so paged_attention
reads q_lens / kv_lens to the host once per call.
"""
from __future__ import annotations

import importlib

import torch

from lmport import ops
from lmport.platform.backend import Backend, Capabilities, ProbeResult
from lmport.platform.probe import probe_torch_plugin
from lmport.kv import quant
from lmport.kv.layout import LayerCache
from lmport.units import ceil_div
from lmport.weights.format import unpack_int4

_FIA_DTYPES = (torch.float16, torch.bfloat16)
_MASK_SIDE = 2048  # sparse_mode=3 takes this fixed-size lower-triangular mask


class AscendBackend(Backend):
    capabilities = Capabilities(
        device_type="ascend",
        torch_device="npu",
        kv_quant_policies=frozenset({0, 4, 8}),
        # No fp8 KV format (kv_fp8_formats): FIA's KV antiquant inputs, as its pages document them, are int8 and int4
        # codes with float scales; none is a float8 KV cache, so quant_policy="fp8" is refused here.
        weight_formats=frozenset({"int4", "int8"}),
        default_block_size=128,
        block_size_min=16,
        block_size_power_of_two=True,
        dist_backend="hccl",
        ray_resource="NPU",
        priority=90,
        default_dtype="float16",
    )

    @classmethod
    def probe(cls) -> ProbeResult:
        return probe_torch_plugin("torch_npu", "npu", "NPU")

    def __init__(self, device: str | torch.device | None = None) -> None:
        # Importing torch_npu registers the "npu" device and torch.npu; keep both.
        self._npu = importlib.import_module("torch_npu")
        self.device_module = torch.npu
        super().__init__(device)
        self._masks: dict[torch.device, torch.Tensor] = {}

    # -- ops ------------------------------------------------------------
    def quant_linear(self, x: torch.Tensor, weight: ops.QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype not in _FIA_DTYPES or x.dim() != 2:
            return super().quant_linear(x, weight, bias)
        scale = weight.scales.float()
        offset = weight.mins.float() / scale
        if weight.bits == 8:
            packed = weight.qweight.T                                   # (in, out) int8
        else:
            offset = offset + 8
            signed = (unpack_int4(weight.qweight).to(torch.int32) - 8).T  # (in, out), -8..7
            shifts = torch.arange(8, dtype=torch.int32, device=signed.device) * 4
            packed = ((signed.reshape(signed.shape[0], -1, 8) & 15) << shifts).sum(-1, dtype=torch.int32)
        return self._npu.npu_weight_quant_batchmatmul(
            x, packed, scale.T.to(x.dtype).contiguous(), offset.T.to(x.dtype).contiguous(),
            bias=bias, antiquant_group_size=weight.group_size)

    def fill_kv_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                      slot_mapping: torch.Tensor) -> None:
        index = slot_mapping.view(-1, 1)
        for values, params, x in ((cache.k, cache.k_qparams, k), (cache.v, cache.v_qparams, v)):
            slots = values.view(-1, *values.shape[2:])          # [blocks * slots, heads, dim]
            if cache.quant_policy == 0:
                self._npu.npu_scatter_nd_update_(slots, index, x.to(slots.dtype).contiguous())
                continue
            codes, qparams = quant.quantize(x, cache.quant_policy, params.dtype)
            self._npu.npu_scatter_nd_update_(slots.view(torch.int8), index, codes.view(torch.int8))
            self._npu.npu_scatter_nd_update_(params.view(-1, *params.shape[2:]), index, qparams)

    def paged_attention(self, q: torch.Tensor, cache: LayerCache, meta: ops.AttentionMetadata,
                        softmax_scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        _, hq, d = q.shape
        hkv = cache.k.shape[2]  # [blocks, slots, heads, dim or packed dim]
        if q.dtype not in _FIA_DTYPES or d % 16 or d > 512 or hq // hkv > 64 or meta.window is not None \
                or meta.softcap is not None:
            return super().paged_attention(q, cache, meta, softmax_scale, new_kv)
        common = dict(num_heads=hq, num_key_value_heads=hkv, input_layout="BSND", scale=softmax_scale,
                      actual_seq_lengths_kv=list(meta.kv_lens_host))
        if meta.is_decode:
            query = q.contiguous().view(meta.num_seqs, 1, hq, d)
            key, value, extra = self._decode_kv(cache, meta, q.dtype, new_kv)
            out, _ = self._npu.npu_fused_infer_attention_score(query, key, value, **common, **extra)
            return out.view(q.shape)

        # Prefill (with history): pad the new tokens to [B, max_q_len] and let
        # rightDownCausal place each sequence's queries at the end of its keys.
        seq, step = _token_slots(meta, q.shape[0])
        query = q.new_zeros(meta.num_seqs, meta.max_q_len, hq, d)
        query[seq, step] = q
        bs = meta.block_size
        if cache.quant_policy == 0 and bs % 128 == 0 and bs <= 512:
            key, value, extra = _paged_kv(cache, meta)
        else:
            (key, value), extra = _gathered_kv(cache, meta, q.dtype, new_kv, (seq, step)), {}
        out, _ = self._npu.npu_fused_infer_attention_score(
            query, key, value, atten_mask=self._causal_mask(q.device), sparse_mode=3,
            actual_seq_lengths=list(meta.q_lens_host), **common, **extra)
        return out[seq, step]

    def _decode_kv(self, cache: LayerCache, meta: ops.AttentionMetadata, dtype: torch.dtype,
                   new_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """(key, value, extra FIA kwargs) for a decode step. INT8 runs FIA's antiquant over the codes, the new
        token's own too; the gathered fallback puts the new token's K and V back as computed."""
        if cache.quant_policy == 0 and meta.block_size <= 512:
            return _paged_kv(cache, meta)
        if cache.quant_policy == 8:
            tables = _tables(meta)
            k, k_scale, k_offset = _signed_int8(cache.k, cache.k_qparams, tables)
            v, v_scale, v_offset = _signed_int8(cache.v, cache.v_qparams, tables)
            return k, v, dict(key_antiquant_scale=k_scale, key_antiquant_offset=k_offset,
                              value_antiquant_scale=v_scale, value_antiquant_offset=v_offset,
                              key_antiquant_mode=3, value_antiquant_mode=3)
        seq = torch.arange(meta.num_seqs, device=meta.q_lens.device)
        key, value = _gathered_kv(cache, meta, dtype, new_kv, (seq, torch.zeros_like(seq)))
        return key, value, {}

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:  # a constant, built once per device
            self._masks[device] = torch.ones(_MASK_SIDE, _MASK_SIDE, dtype=torch.bool, device=device).triu(1)
        return self._masks[device]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dtype != x.dtype:  # npu_rms_norm wants gamma in x's dtype
            return super().rms_norm(x, weight, eps)
        return self._npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = q.shape[-1]
        if not (q.dtype == k.dtype == cos.dtype == sin.dtype) or d % 2 or d >= 896:
            return super().apply_rotary(q, k, cos, sin)
        r1 = cos[None, :, None, :].contiguous()
        r2 = sin[None, :, None, :].contiguous()
        return tuple(self._npu.npu_rotary_mul(x.contiguous().unsqueeze(0), r1, r2)[0] for x in (q, k))


def _tables(meta: ops.AttentionMetadata) -> torch.Tensor:
    n_blocks = ceil_div(meta.max_kv_len, meta.block_size)
    return meta.block_tables[:, :n_blocks].long()


def _token_slots(meta: ops.AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, step within its new tokens) of every new token, computed on the device."""
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=meta.q_lens.device), meta.q_lens.long(),
                                  output_size=num_tokens)
    step = torch.arange(num_tokens, device=seq.device) - meta.q_start_loc[seq].long()
    return seq, step


def _paged_kv(cache: LayerCache, meta: ops.AttentionMetadata):
    """The cache itself, as FIA's page-attention layout (blocknum, blocksize, H)."""
    blocks, bs = cache.k.shape[:2]
    return (cache.k.view(blocks, bs, -1), cache.v.view(blocks, bs, -1),
            dict(block_table=meta.block_tables, block_size=bs))


def _gathered_kv(cache: LayerCache, meta: ops.AttentionMetadata, dtype: torch.dtype,
                 new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 token_slots: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Fallback: the named blocks, dequantized by the reference, as contiguous [B, S, H, D]; over a quantized
    cache with ``new_kv``, the step's own tokens (at ``token_slots``: sequence, step) as computed
    (lmport.ops.attention)."""
    tables = _tables(meta)
    key, value = (ops.gather_kv(values, params, tables, cache.quant_policy, dtype)
                  for values, params in ((cache.k, cache.k_qparams), (cache.v, cache.v_qparams)))
    if cache.quant_policy and new_kv is not None and token_slots is not None:
        seq, step = token_slots
        pos = meta.kv_lens[seq].long() - meta.q_lens[seq].long() + step
        key[seq, pos], value[seq, pos] = new_kv[0].to(key.dtype), new_kv[1].to(value.dtype)
    return key, value


def _signed_int8(values: torch.Tensor, qparams: torch.Tensor, tables: torch.Tensor):
    """INT8 codes of the named blocks as FIA's int8 [B, S, H, D] plus float32 (B, H, S) scale and offset.

    x = (q - zero) * scale = ((q - 128) + (128 - zero)) * scale, and q ^ 0x80 is q - 128 as int8.
    """
    codes = (values[tables].flatten(1, 2) ^ 0x80).view(torch.int8)
    params = qparams[tables].flatten(1, 2).float()                    # [B, S, H, 2]
    scale = params[..., 0].transpose(1, 2).contiguous()
    offset = (128 - params[..., 1]).transpose(1, 2).contiguous()
    return codes, scale, offset
