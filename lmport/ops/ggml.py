"""Reference ops on GGUF block weights (lmport.weights.ggml): gguf's own dequantizer, then the float op."""
from __future__ import annotations

import numpy as np
import torch

from lmport.weights.ggml import GGMLWeight
from lmport.weights.interleaved import file_layout, file_rows


def dequantize_ggml(weight: GGMLWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float [out, in] weight, dequantized by ``gguf.quants.dequantize`` (llama.cpp's reference
    dequantizers, ported to numpy): the ground truth every backend's kernel is compared with. Rows a
    backend interleaved are put back in the file's layout first."""
    import gguf
    weight = file_layout(weight)
    qtype = gguf.GGMLQuantizationType[weight.type_name.upper()]
    blocks = weight.blocks.detach().cpu().numpy()
    w = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))
    return w.reshape(weight.out_features, weight.in_features).to(device=weight.blocks.device, dtype=dtype)


def ggml_linear(x: torch.Tensor, weight: GGMLWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize_ggml(weight, x.dtype), bias)


def ggml_embedding(ids: torch.Tensor, weight: GGMLWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a GGUF block embedding table; only the gathered rows are dequantized."""
    return dequantize_ggml(file_rows(weight, ids.reshape(-1)), dtype).reshape(*ids.shape, weight.in_features)
