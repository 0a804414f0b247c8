"""Model layers over quantized weights: the internal int4 / int8 format (lmport.weights.format) and
GGUF blocks held as the file stores them (lmport.weights.ggml).

``QuantLinear`` / ``QuantEmbedding`` and ``GGMLLinear`` / ``GGMLEmbedding`` replace a float ``Linear`` /
``nn.Embedding`` of the paged model by name when a loader hands a quantized weight for it; float and
quantized layers mix freely. A tied LM head shares its embedding's buffers. ``QuantExperts`` replaces a
mixture-of-experts block's float experts when their gate, up and down weights come quantized, each
stacked over the experts as a GGUF's ``ffn_*_exps`` stores them (an fp8 checkpoint's, codes and block scales,
stacked alike).
"""
from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

import torch
from torch import nn

from lmport import ops
from lmport.platform.backend import Backend
from lmport.weights import tensors
from lmport.weights.format import QuantizedWeight
from lmport.weights.fp8 import Fp8Weight
from lmport.weights.ggml import GGMLWeight
from lmport.weights.residency import page_out

W = TypeVar("W", QuantizedWeight, GGMLWeight, Fp8Weight)


class HoldsWeight(nn.Module, Generic[W]):
    """A quantized weight's tensors as buffers (named after its fields) and its other fields as attributes;
    ``quantized`` rebuilds the weight from them once (a decode step asks for it a few hundred times)."""

    def __init__(self, weight: W):
        super().__init__()
        self._kind = type(weight)
        self.hold(weight)

    def hold(self, weight: W) -> None:
        """Hold ``weight`` (of this module's kind) in place of what it held."""
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
        if isinstance(w, Fp8Weight):
            return f"in={w.in_features}, out={w.out_features}, fp8 e4m3, {w.block_out}x{w.block_in} scale blocks"
        kind = (f"{w.type_name}" if isinstance(w, GGMLWeight) else f"int{w.bits}, group={w.group_size}")
        return f"in={w.in_features}, out={w.out_features}, {kind}"


class _Linear(HoldsWeight[W]):
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


class Fp8Linear(_Linear[Fp8Weight]):
    """A linear over float8 e4m3 weights and their block scales (lmport.weights.fp8), kept in fp8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.fp8_linear(x, self.quantized, self.bias)


class QuantHeadLinear(HoldsWeight[W]):
    """A per-head projection (lmport.models.layers.HeadParallelLinear) over a quantized weight."""

    def __init__(self, weight: W, heads: int, backend: Backend):
        super().__init__(weight)
        self.heads = heads
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.head_linear(x, self.quantized)


class _Embedding(HoldsWeight[W]):
    def __init__(self, weight: W, dtype: torch.dtype, backend: Backend):
        super().__init__(weight)
        self.dtype = dtype
        self.backend = backend


class QuantEmbedding(_Embedding[QuantizedWeight]):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.quant_embedding(ids, self.quantized, self.dtype)


class GGMLEmbedding(_Embedding[GGMLWeight]):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.ggml_embedding(ids, self.quantized, self.dtype)


def hold_for_backend(model: nn.Module, backend: Backend, dtype: torch.dtype) -> None:
    """Each quantized linear's weight in the layout the backend's kernels read it in
    (``Backend.hold_quantized``), each per-head projection's (``Backend.hold_heads``) and each experts block's
    (``Backend.hold_experts``), the pages under what was relaid handed back. The embedding of a tied LM head holds
    the head's weight as held (its lookup takes rows from any layout: lmport.weights.interleaved.file_rows); an
    embedding of its own stays as it is."""
    embeddings = [m for m in model.modules() if isinstance(m, _Embedding)]
    for module in model.modules():
        if isinstance(module, QuantExperts):
            module.hold_for(dtype)
        if not isinstance(module, (_Linear, QuantHeadLinear)):
            continue
        old = module.quantized
        held = (backend.hold_heads(old, module.heads, dtype) if isinstance(module, QuantHeadLinear)
                else backend.hold_quantized(old, dtype))
        if held is not old:
            rehold(module, held)
            for embedding in embeddings:
                if _codes(embedding.quantized).data_ptr() == _codes(old).data_ptr():
                    embedding.hold(held)


def rehold(module: HoldsWeight, held) -> None:
    """``module`` holding ``held`` in place of its weight, the pages under what was copied (not relaid in place)
    handed back."""
    before = list(tensors(module.quantized).values())
    module.hold(held)
    kept = {t.data_ptr() for t in tensors(held).values()}
    page_out([t for t in before if t.data_ptr() not in kept])


def _codes(weight: QuantizedWeight | GGMLWeight) -> torch.Tensor:
    return weight.blocks if isinstance(weight, GGMLWeight) else weight.qweight


# The names a loader hands a mixture-of-experts block's quantized experts under ("<block>.experts.gate_proj").
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


class QuantExperts(nn.Module):
    """A mixture-of-experts block's experts over quantized weights: gate, up and down each one weight stacked
    over the experts (``experts * rows`` output rows, the experts' rows in turn, as a GGUF's ``ffn_*_exps``
    holds them), so the file's blocks load as they are; run by ``Backend.quantized_moe`` (lmport.ops.moe's
    ``QuantizedExperts`` describes them). Gate, up and down may be of different kinds (a Q4_K_M file's Q4_K gate
    and up, Q6_K down). ``scale_inputs``: the routing weight scales each expert's input (Llama 4)."""

    # Backend.quantized_moe may read each expert's token count on the host: a decode step holding these is not
    # captured.
    reads_on_host = True

    def __init__(self, gate: QuantizedWeight | GGMLWeight | Fp8Weight, up: QuantizedWeight | GGMLWeight | Fp8Weight,
                 down: QuantizedWeight | GGMLWeight | Fp8Weight, num_experts: int, backend: Backend,
                 scale_inputs: bool = False):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (HoldsWeight(w) for w in (gate, up, down))
        self.num_experts = num_experts
        self.backend = backend
        self.scale_inputs = scale_inputs
        self._described: ops.QuantizedExperts | None = None   # built at the first call (its views with it)

    def described(self, clamp: tuple[float, float] | None = None) -> ops.QuantizedExperts:
        """These experts as the backend runs them; ``clamp``: gpt-oss's activation (QuantBiasedExperts)."""
        if self._described is None or self._described.clamp != clamp:
            stacked = (m.quantized for m in (self.gate_proj, self.up_proj, self.down_proj))
            self._described = ops.QuantizedExperts(*stacked, self.num_experts, biases=self.biases(), clamp=clamp,
                                                   scale_inputs=self.scale_inputs)
        return self._described

    def biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The biases of gate, up and down ([experts, rows] each), where the experts have them."""
        return None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.quantized_moe(x, self.described(), weights, ids)

    def hold_for(self, dtype: torch.dtype) -> None:
        """The stacked weights in the layout the backend's kernels read them in (``Backend.hold_experts``)."""
        held = self.backend.hold_experts(self.described(), dtype)
        for part, weight in zip((self.gate_proj, self.up_proj, self.down_proj), (held.gate, held.up, held.down),
                                strict=True):
            if weight is not part.quantized:
                rehold(part, weight)
        self._described = None

    def _apply(self, fn, recurse=True):
        self._described = None   # .to() and the like replace the stacked tensors
        return super()._apply(fn, recurse)


def _install_experts(model: nn.Module, quantized: dict[str, QuantizedWeight | GGMLWeight | Fp8Weight],
                     backend: Backend) -> set[str]:
    """Swap each experts module named in ``quantized`` (its gate, up and down: "<block>.experts.gate_proj", ...)
    for QuantExperts; the names consumed."""
    consumed = set()
    for module_name in sorted({n.rpartition(".")[0] for n in quantized if n.endswith(".experts.gate_proj")}):
        names = [f"{module_name}.{part}" for part in EXPERT_PARTS]
        missing = [n for n in names if n not in quantized]
        if missing:
            raise ValueError(f"{module_name}: quantized experts need gate, up and down quantized; "
                             f"{', '.join(missing)} are not")
        old = model.get_submodule(module_name)
        gate, up, down = (quantized[n] for n in names)
        parent_name, _, attr = module_name.rpartition(".")
        twin = getattr(old, "quantized_experts", None)   # experts of another layout (gpt-oss's, with biases)
        if callable(twin):
            setattr(model.get_submodule(parent_name), attr, twin(gate, up, down, backend))
            consumed.update(names)
            continue
        num_experts, gate_up_rows, hidden = old.get_parameter("gate_up_proj").shape
        inter = gate_up_rows // 2
        for name, w, want in zip(names, (gate, up, down), ((inter, hidden), (inter, hidden), (hidden, inter)),
                                 strict=True):
            if (w.out_features, w.in_features) != (num_experts * want[0], want[1]):
                raise ValueError(f"{name}: quantized experts are [{w.out_features}, {w.in_features}] but the model "
                                 f"config makes them {num_experts} x {list(want)}")
        setattr(model.get_submodule(parent_name), attr, QuantExperts(gate, up, down, num_experts, backend))
        consumed.update(names)
    return consumed


def install(model: nn.Module, quantized: dict[str, QuantizedWeight | GGMLWeight | Fp8Weight],
            floats: dict[str, torch.Tensor],
            backend: Backend, dtype: torch.dtype) -> None:
    """Swap each layer named in ``quantized`` ("model.layers.0.mlp.up_proj.weight" ->
    the module "model.layers.0.mlp.up_proj") for its quantized twin; ``floats`` may hold its bias. A
    mixture-of-experts block's experts come as "<block>.experts.gate_proj" / "up_proj" / "down_proj" (an fp8
    checkpoint's, stored one by one, stacked so by lmport.weights.fp8.stack_quantized_experts)."""
    experts = _install_experts(model, quantized, backend)
    for name, weight in quantized.items():
        if name in experts:
            continue
        module_name = name.removesuffix(".weight")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        want = tuple(old.weight.shape)
        if (weight.out_features, weight.in_features) != want:
            raise ValueError(f"{name}: quantized weight is [{weight.out_features}, {weight.in_features}] "
                             f"but the model config makes it {list(want)}")
        blocks = isinstance(weight, GGMLWeight)
        heads = getattr(old, "heads", None)   # a per-head projection (lmport.models.layers.HeadParallelLinear)
        if heads is not None:
            if isinstance(weight, Fp8Weight):
                raise ValueError(f"{name}: a per-head projection in fp8 is not supported; use "
                                 "weight_format='dequantize'")
            setattr(parent, attr, QuantHeadLinear(weight, heads, backend))
            continue
        if isinstance(weight, Fp8Weight):
            if isinstance(old, nn.Embedding):
                raise ValueError(f"{name}: an fp8 embedding table is not supported; use weight_format='dequantize'")
            bias = floats.get(f"{module_name}.bias")
            setattr(parent, attr, Fp8Linear(weight, None if bias is None else bias.to(dtype), backend))
            continue
        if isinstance(old, nn.Embedding):
            new = GGMLEmbedding(weight, dtype, backend) if blocks else QuantEmbedding(weight, dtype, backend)
        else:
            bias = floats.get(f"{module_name}.bias")   # also loaded by name with the other floats
            bias = None if bias is None else bias.to(dtype)
            new = GGMLLinear(weight, bias, backend) if blocks else QuantLinear(weight, bias, backend)
        setattr(parent, attr, new)
