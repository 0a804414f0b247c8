"""The layers every architecture builds from: RMSNorm, the tensor-parallel linears and embedding, the
rotary glue, and a linear's weights as data for a backend's decoder runner (lmport.ops.decoder).

Every device-specific op goes through the backend. The quantized linears a loader swaps in for these
are in lmport.models.quantized. Under tensor parallelism (lmport.parallel) a layer holds one rank's
shard, named by ``shard_dim`` and ``shard_range``.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport import ops
from lmport.platform.backend import Backend
from lmport.models.quantized import GGMLLinear, QuantLinear
from lmport.parallel import TPGroup, split


class RMSNorm(nn.Module):
    """RMSNorm scaling by ``weight + offset``: Gemma's checkpoints store the weight less one (offset 1)."""

    def __init__(self, size: int, eps: float, backend: Backend, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + self.offset if self.offset else self.weight
        return self.backend.rms_norm(x, weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear whose matmul the backend runs (a BLAS may want another operand order)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: Backend):
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """This rank's rows [start, end) of the full weight's output features (bias split alike)."""

    shard_dim = 0

    def __init__(self, in_features: int, out_range: tuple[int, int], bias: bool, backend: Backend):
        super().__init__(in_features, out_range[1] - out_range[0], bias, backend)
        self.shard_range = out_range


class HeadParallelLinear(ColumnParallelLinear):
    """Each of this rank's heads through its own ``out_features // heads`` rows of the weight: x [T, heads, in]
    -> [T, heads, out] (MLA's absorbed projections, lmport.ops.mla); the rows of the heads [h0, h1) under tp."""

    def __init__(self, in_features: int, head_rows: int, head_range: tuple[int, int], backend: Backend):
        super().__init__(in_features, (head_range[0] * head_rows, head_range[1] * head_rows), False, backend)
        self.heads = head_range[1] - head_range[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.head_linear(x, self.weight)


class RowParallelLinear(Linear):
    """This rank's input features [start, end) of the full weight; the partial results are summed
    over the ranks (one all-reduce), then the (replicated) bias is added once."""

    shard_dim = 1

    def __init__(self, in_range: tuple[int, int], out_features: int, bias: bool, backend: Backend, tp: TPGroup):
        super().__init__(in_range[1] - in_range[0], out_features, bias, backend)
        self.shard_range = in_range
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.backend.linear(x, self.weight, None).contiguous())
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, end) of the embedding; other tokens look up zeros, and one all-reduce
    sums the ranks (each token's row lives on exactly one rank, so the sum is exact)."""

    shard_dim = 0

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        start, end = split(vocab_size, tp.size, tp.rank)
        super().__init__(end - start, hidden)
        self.shard_range = (start, end)
        self.tp = tp

    def reset_parameters(self) -> None:
        """Built on the meta device (as the loaders build models, the weights assigned after), nothing to
        initialize: ``nn.init.normal_`` on a meta tensor goes through torch's reference implementation,
        whose first call imports ``torch._dynamo`` (1.5-2.5 s of a cold load, with the RSS it adds)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        start, end = self.shard_range
        local = (ids >= start) & (ids < end)
        x = super().forward(torch.where(local, ids - start, 0)) * local[:, None]
        return self.tp.all_reduce(x)


def apply_rope(backend: Backend, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [tokens, heads, head_dim] turned by the backend's rotary; with a partial rotary
    (``partial_rotary_factor`` < 1, cos narrower than a head) only the leading dims turn."""
    rot, head_dim = cos.shape[-1], q.shape[-1]
    if rot == head_dim:
        return backend.apply_rotary(q, k, cos, sin)
    qr, kr = backend.apply_rotary(q[..., :rot].contiguous(), k[..., :rot].contiguous(), cos, sin)
    return torch.cat([qr, q[..., rot:]], -1), torch.cat([kr, k[..., rot:]], -1)


def norm_spec(norm: RMSNorm) -> ops.Norm:
    """An RMSNorm as a decoder spec takes it: the scale it applies, its offset added once."""
    return ops.Norm(norm.weight.detach() + norm.offset if norm.offset else norm.weight, norm.eps)


def linear_weights(module: nn.Module | None) -> ops.Linears | None:
    """A float or quantized linear's weight and bias (a tuple of them for parts concatenated: ``parts``);
    None for any other module (a row-parallel linear sums over ranks, which the spec does not)."""
    parts = getattr(module, "parts", None)
    if isinstance(parts, nn.ModuleList):
        weights = [linear_weights(p) for p in parts]
        singles = [w for w in weights if isinstance(w, ops.LinearWeights)]
        return tuple(singles) if len(singles) == len(weights) else None
    if isinstance(module, QuantLinear | GGMLLinear):
        return ops.LinearWeights(module.quantized, module.bias)
    if isinstance(module, Linear) and not (isinstance(module, RowParallelLinear) and module.tp.size > 1):
        return ops.LinearWeights(module.weight, module.bias)
    return None
