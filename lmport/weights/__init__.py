"""Quantized weights: the internal format (format.py), and loaders that map checkpoints onto it."""
from __future__ import annotations

import dataclasses

import torch


def tensors(weight) -> dict[str, torch.Tensor]:
    """A quantized weight's tensors by field name (QuantizedWeight's qweight, scales and mins; GGMLWeight's
    blocks): what moves, is copied or is sliced with it."""
    return {f.name: value for f in dataclasses.fields(weight)
            if isinstance(value := getattr(weight, f.name), torch.Tensor)}


def row_range(weight, start: int, stop: int):
    """The output rows [start, stop) of a quantized weight, as views of its tensors (no copy)."""
    return dataclasses.replace(weight, **{name: t[start:stop] for name, t in tensors(weight).items()})
