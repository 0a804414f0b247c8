"""Reference ops on quantized weights: dequantize each group, then the float op."""
from __future__ import annotations

import torch

from lmport.weights.format import QuantizedWeight, unpack_int4
from lmport.weights.interleaved import file_layout, file_rows


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w = scale * q + min, computed in float32 (as GGUF's reference dequantizers do), then cast. Rows a
    backend interleaved are put back in order first."""
    weight = file_layout(weight)
    n, k, g = weight.out_features, weight.in_features, weight.group_size
    codes = unpack_int4(weight.qweight) if weight.bits == 4 else weight.qweight
    q = codes.to(torch.float32).reshape(n, k // g, g)
    w = q * weight.scales.float()[..., None] + weight.mins.float()[..., None]
    return w.reshape(n, k).to(dtype)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)


def quant_embedding(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a quantized embedding table; only the gathered rows are dequantized."""
    return dequantize(file_rows(weight, ids.reshape(-1)), dtype).reshape(*ids.shape, weight.in_features)
