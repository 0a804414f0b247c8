"""Write new K/V into the paged cache through the slot mapping, quantizing when asked."""
from __future__ import annotations

import torch

from lmport.kv import quant
from lmport.kv.layout import LayerCache


def _write(cache: torch.Tensor, qparams: torch.Tensor | None, scale: torch.Tensor | None, x: torch.Tensor,
           slot_mapping: torch.Tensor, quant_policy: int | str) -> None:
    flat = cache.view(-1, *cache.shape[2:])
    if quant_policy == 0:
        flat.index_copy_(0, slot_mapping, x.to(cache.dtype))
        return
    if quant.is_fp8(quant_policy):
        # as bytes: torch's index_copy_ has no float8 kernel on the CPU
        flat.view(torch.uint8).index_copy_(0, slot_mapping, quant.quantize_fp8(x, scale).view(torch.uint8))
        return
    values, params = quant.quantize(x, quant_policy, qparams.dtype)
    flat.index_copy_(0, slot_mapping, values)
    qparams.view(-1, *qparams.shape[2:]).index_copy_(0, slot_mapping, params)


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; writes token t into slot ``slot_mapping[t]``."""
    cache.require_axis_order("bshd", "the reference fill_kv_cache")
    _write(cache.k, cache.k_qparams, cache.k_scale, k, slot_mapping, cache.quant_policy)
    _write(cache.v, cache.v_qparams, cache.v_scale, v, slot_mapping, cache.quant_policy)
