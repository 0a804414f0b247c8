"""Copy whole blocks between two cache pools (device<->device, device<->host)."""
from __future__ import annotations

import torch

from lmport.kv.layout import LayerCache


def copy_blocks(src: list[LayerCache], dst: list[LayerCache], src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every layer, values and qparams."""
    for s, d in zip(src, dst, strict=True):
        for a, b in ((s.k, d.k), (s.v, d.v), (s.k_qparams, d.k_qparams), (s.v_qparams, d.v_qparams)):
            if a is not None:
                if a.dtype == torch.float8_e4m3fn:   # as bytes: index_copy_ has no float8 kernel on the CPU
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                b.index_copy_(0, dst_ids.to(b.device), a.index_select(0, src_ids.to(a.device)).to(b.device))
