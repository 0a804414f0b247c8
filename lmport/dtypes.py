"""Dtype names (EngineConfig.dtype, resolved: never "auto") and the torch dtypes they stand for."""
from __future__ import annotations

import torch

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved dtype name."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(TORCH_DTYPES)} (resolve the config first)") \
            from None
