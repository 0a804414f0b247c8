"""Model layers over quantized weights: the internal int4 / int8 format (lmport.weights.format) and
GGUF blocks held as the file stores them (lmport.weights.ggml).

``QuantLinear`` / ``QuantEmbedding`` and ``GGMLLinear`` / ``GGMLEmbedding`` replace a float ``Linear`` /
``nn.Embedding`` of the paged model by name when a loader hands a quantized weight for it; float and
quantized layers mix freely. A tied LM head shares its embedding's buffers.
"""
from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

import torch
from torch import nn

from lmport import ops
from lmport.backend import Backend
from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import GGMLWeight

W = TypeVar("W", QuantizedWeight, GGMLWeight)


class _HoldsWeight(nn.Module, Generic[W]):
    """A quantized weight's tensors as buffers (named after its fields) and its other fields as attributes;
    ``quantized`` rebuilds the weight from them once (a decode step asks for it a few hundred times)."""

    def __init__(self, weight: W):
        super().__init__()
        self._kind = type(weight)
        for f in dataclasses.fields(weight):
            value = getattr(weight, f.name)
            if isinstance(value, torch.Tensor):
                # Not in the state dict: the loaders fill these, and float state dicts load around them.
                self.register_buffer(f.name, value, persistent=False)
            else:
                setattr(self, f.name, value)
        self._weight: W | None = None

    @property
    def quantized(self) -> W:
        if self._weight is None:
            self._weight = self._kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self._kind)})
        return self._weight

    def _apply(self, fn, recurse=True):
        self._weight = None   # .to() and the like replace the buffers
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        w = self.quantized
        kind = (f"{w.type_name}" if isinstance(w, GGMLWeight) else f"int{w.bits}, group={w.group_size}")
        return f"in={w.in_features}, out={w.out_features}, {kind}"


class _Linear(_HoldsWeight[W]):
    def __init__(self, weight: W, bias: torch.Tensor | None, backend: Backend):
        super().__init__(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.backend = backend


class QuantLinear(_Linear[QuantizedWeight]):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.quant_linear(x, self.quantized, self.bias)


class GGMLLinear(_Linear[GGMLWeight]):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.ggml_linear(x, self.quantized, self.bias)


class _Embedding(_HoldsWeight[W]):
    def __init__(self, weight: W, dtype: torch.dtype):
        super().__init__(weight)
        self.dtype = dtype


class QuantEmbedding(_Embedding[QuantizedWeight]):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.quant_embedding(ids, self.quantized, self.dtype)


class GGMLEmbedding(_Embedding[GGMLWeight]):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.ggml_embedding(ids, self.quantized, self.dtype)


def install(model: nn.Module, quantized: dict[str, QuantizedWeight | GGMLWeight], floats: dict[str, torch.Tensor],
            backend: Backend, dtype: torch.dtype) -> None:
    """Swap each layer named in ``quantized`` ("model.layers.0.mlp.up_proj.weight" ->
    the module "model.layers.0.mlp.up_proj") for its quantized twin; ``floats`` may hold its bias."""
    for name, weight in quantized.items():
        module_name = name.removesuffix(".weight")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        want = tuple(old.weight.shape)
        if (weight.out_features, weight.in_features) != want:
            raise ValueError(f"{name}: quantized weight is [{weight.out_features}, {weight.in_features}] "
                             f"but the model config makes it {list(want)}")
        blocks = isinstance(weight, GGMLWeight)
        if isinstance(old, nn.Embedding):
            new = GGMLEmbedding(weight, dtype) if blocks else QuantEmbedding(weight, dtype)
        else:
            bias = floats.get(f"{module_name}.bias")   # also loaded by name with the other floats
            bias = None if bias is None else bias.to(dtype)
            new = GGMLLinear(weight, bias, backend) if blocks else QuantLinear(weight, bias, backend)
        setattr(parent, attr, new)
