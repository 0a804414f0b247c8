"""Model layers over quantized weights: the internal int4 / int8 format (lmport.weights.format) and
GGUF blocks held as the file stores them (lmport.weights.ggml).

``QuantLinear`` / ``QuantEmbedding`` and ``GGMLLinear`` / ``GGMLEmbedding`` replace a float ``Linear`` /
``nn.Embedding`` of the paged model by name when a loader hands a quantized weight for it; float and
quantized layers mix freely. A tied LM head shares its embedding's buffers.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport import ops
from lmport.backend import Backend
from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import GGMLWeight


class _Quantized(nn.Module):
    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        # Not in the state dict: the loaders fill these, and float state dicts load around them.
        self.register_buffer("qweight", weight.qweight, persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)
        self.register_buffer("mins", weight.mins, persistent=False)
        self.bits, self.group_size = weight.bits, weight.group_size
        self._weight: QuantizedWeight | None = None

    @property
    def quantized(self) -> QuantizedWeight:
        if self._weight is None:   # built once: a decode step asks for it a few hundred times
            self._weight = QuantizedWeight(self.qweight, self.scales, self.mins, self.bits, self.group_size)
        return self._weight

    def _apply(self, fn, recurse=True):
        self._weight = None   # .to() and the like replace the buffers
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        q = self.quantized
        return f"in={q.in_features}, out={q.out_features}, int{self.bits}, group={self.group_size}"


class QuantLinear(_Quantized):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, backend: Backend):
        super().__init__(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.quant_linear(x, self.quantized, self.bias)


class QuantEmbedding(_Quantized):
    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__(weight)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.quant_embedding(ids, self.quantized, self.dtype)


class _Blocks(nn.Module):
    def __init__(self, weight: GGMLWeight):
        super().__init__()
        # Not in the state dict, as for _Quantized.
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.type_name, self.in_features = weight.type_name, weight.in_features
        self._weight: GGMLWeight | None = None

    @property
    def quantized(self) -> GGMLWeight:
        if self._weight is None:
            self._weight = GGMLWeight(self.blocks, self.type_name, self.in_features)
        return self._weight

    def _apply(self, fn, recurse=True):
        self._weight = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.quantized.out_features}, {self.type_name}"


class GGMLLinear(_Blocks):
    def __init__(self, weight: GGMLWeight, bias: torch.Tensor | None, backend: Backend):
        super().__init__(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.ggml_linear(x, self.quantized, self.bias)


class GGMLEmbedding(_Blocks):
    def __init__(self, weight: GGMLWeight, dtype: torch.dtype):
        super().__init__(weight)
        self.dtype = dtype

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
