"""camb backend: Cambricon MLUs through torch_mlu and Torch-MLU-Ops (``torch_mlu_ops``).

Which operator each op runs on, and where its signature, layouts and dtypes
were checked (the docstrings of Torch-MLU-Ops' Python API, torch_mlu_ops/_ops.py,
and its callers in Cambricon/vllm-mlu vllm_mlu/attention/backends/flash_attn.py
and DeepLink-org/dlinfer dlinfer/vendor/camb/camb_ops.py):

- The KV cache is laid out [blocks, kv_heads, block_size, head_dim] ("bhsd"),
  the paged layout of all three operators below; block size 16, the only block
  size paged ``flash_attention`` takes ("block_size only support 16").
- fill_kv_cache: ``torch_mlu_ops.reshape_paged_cache(k, v, k_cache, v_cache,
  slot_mapping)`` (k/v [tokens, kv_heads, head_dim], slot_mapping int32).
- paged_attention, decode: ``torch_mlu_ops.single_query_cached_kv_attn(q, k_cache,
  v_cache, out, block_tables, context_lens, None, None, None, max_context_len,
  -1, -1, softmax_scale)`` with q and out as (batch, 1, heads, head_dim), int32
  block tables and context lengths (= kv_lens), windows -1 (unlimited).
- paged_attention, prefill (with history): ``torch_mlu_ops.flash_attention(q, k_cache,
  v_cache, out, cu_seq_lens_q, cu_seq_lens_kv, None, None, max_seq_len_q,
  max_seq_len_kv, softmax_scale, is_causal=True, block_tables=...)`` on the packed
  queries, as vLLM-MLU calls it for prefix-cached prefill: the causal mask is
  aligned to the end of each sequence's keys.
- paged_attention, sliding-window layers (``meta.window``): the reference op, stated
  fallback. Both operators above take a left window (``windows_size_left`` /
  ``window_size_left``), but the simulated module does not model it, so a call
  through it could not be checked here. Soft-capped layers (``meta.softcap``, Gemma 2)
  too: neither operator takes a soft cap.
- rms_norm: ``torch_mlu_ops.fused_rms_norm(x, None, weight, None, None, eps, False)``
  (x in float/half/bfloat16, weight in x's dtype; otherwise the reference).
- apply_rotary, copy_blocks: the reference ops (plain torch on the MLU).
- memory_info / synchronize: ``torch.mlu.mem_get_info`` / ``torch.mlu.synchronize``.

No KV quantization is declared (Torch-MLU-Ops quantizes KV per token with a
symmetric scale, not lmport's asymmetric per-token-per-head scheme), so
``quant_policy > 0`` is rejected when the config is checked.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch
import torch.nn.functional as F

from lmport import ops
from lmport.platform.backend import Backend, Capabilities, ProbeResult
from lmport.platform.probe import probe_torch_plugin
from lmport.kv.layout import LayerCache


class CambBackend(Backend):
    capabilities = Capabilities(
        device_type="camb",
        torch_device="mlu",
        kv_quant_policies=frozenset({0}),   # and no fp8 KV format (kv_fp8_formats): the cached-KV ops take 16-bit K/V
        default_block_size=16,
        block_size_forced=16,
        dist_backend="cncl",
        ray_resource="MLU",
        priority=80,
        default_dtype="float16",
        kv_axis_order="bhsd",
    )

    @classmethod
    def probe(cls) -> ProbeResult:
        return probe_torch_plugin("torch_mlu", "mlu", "MLU", also=("torch_mlu_ops",))

    def __init__(self, device: str | torch.device | None = None) -> None:
        # Importing torch_mlu registers the "mlu" device and torch.mlu; keep both modules.
        importlib.import_module("torch_mlu")
        self._tmo = importlib.import_module("torch_mlu_ops")
        self.device_module = torch.mlu
        super().__init__(device)

    # -- ops ------------------------------------------------------------
    def fill_kv_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                      slot_mapping: torch.Tensor) -> None:
        _check_unquantized(cache)
        self._tmo.reshape_paged_cache(k.to(cache.k.dtype).contiguous(), v.to(cache.v.dtype).contiguous(),
                                      cache.k, cache.v, slot_mapping.to(torch.int32))

    def paged_attention(self, q: torch.Tensor, cache: LayerCache, meta: ops.AttentionMetadata,
                        softmax_scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # new_kv: an unquantized cache holds the step's K and V as they are, so it is read as it is
        _check_unquantized(cache)
        if meta.window is not None or meta.softcap is not None:   # stated fallback: see the module docstring
            return super().paged_attention(q, bshd_view(cache), meta, softmax_scale)
        q = q.contiguous()
        out = torch.empty_like(q)
        if meta.is_decode:
            shape = (meta.num_seqs, 1, *q.shape[1:])  # (batch, seq_q=1, heads, head_dim)
            self._tmo.single_query_cached_kv_attn(
                q.view(shape), cache.k, cache.v, out.view(shape), meta.block_tables, meta.kv_lens,
                None, None, None, meta.max_kv_len, -1, -1, softmax_scale)
            return out
        cu_seq_lens_kv = F.pad(meta.kv_lens.cumsum(0, dtype=torch.int32), (1, 0))
        self._tmo.flash_attention(
            q, cache.k, cache.v, out, meta.q_start_loc, cu_seq_lens_kv, None, None,
            meta.max_q_len, meta.max_kv_len, softmax_scale, True, block_tables=meta.block_tables)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dtype != x.dtype:  # fused_rms_norm takes gamma in x's dtype
            return super().rms_norm(x, weight, eps)
        return self._tmo.fused_rms_norm(x.contiguous(), None, weight, None, None, eps, False)


def bshd_view(cache: LayerCache) -> LayerCache:
    """This backend's [blocks, heads, slots, dim] cache seen as the reference ops' [blocks, slots, heads, dim]."""
    return dataclasses.replace(cache, k=cache.k.transpose(1, 2), v=cache.v.transpose(1, 2), axis_order="bshd")


def _check_unquantized(cache: LayerCache) -> None:
    if cache.quant_policy:
        raise ValueError(f"the camb backend has no KV quantization (quant_policy={cache.quant_policy}); "
                         f"use quant_policy=0")
