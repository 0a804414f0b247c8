"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Both are the Llama-family decoder (lmport.models.llama; Qwen3-MoE with Qwen3's
per-head q/k norm) whose MLP is, on its sparse layers, a router and a set of
gated-MLP experts. Parameter names match transformers' (``mlp.gate.weight``
[experts, hidden]; ``mlp.experts.gate_up_proj`` [experts, 2 * inter, hidden],
``mlp.experts.down_proj`` [experts, hidden, inter]). Routing: softmax in float32,
top-k, renormalized always (Mixtral) or when ``norm_topk_prob`` (Qwen3-MoE); float
experts run through ``Backend.fused_moe``, quantized ones (a GGUF's, lmport.models.quantized.QuantExperts)
expert by expert through the backend's quantized linear. Qwen3-MoE's dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) keep the ordinary MLP.

Under tensor parallelism each expert is split like a dense MLP: every rank holds the same slice of each
expert's intermediate dimension (gate and up by output, down by input), the router is replicated, and the
block's output is one all-reduce of the ranks' partial sums. An expert's intermediate size must divide by
tp (lmport.parallel.experts_tp_problem); Llama 4's and Qwen3-Next's experts are not split yet, so those
models run at tp=1. A GGUF's quantized experts split the same way in their file's blocks, an fp8 checkpoint's in its
scale blocks (``shard_quantized_experts``), never dequantized.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport.errors import ConfigError
from lmport.platform.backend import Backend
from lmport.models.llama import PagedCausalLM
from lmport.ops import route
from lmport.parallel import TPGroup, experts_tp_problem, tp_choices
from lmport.models.quantized import EXPERT_PARTS
from lmport.weights import fp8
from lmport.weights.format import QuantizedWeight
from lmport.weights.fp8 import Fp8Weight
from lmport.weights.ggml import GGMLWeight
from lmport.weights.split import input_range
from lmport.weights.residency import page_out

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")


def refuse_tp(cfg, tp: TPGroup | None) -> None:
    """ConfigError where ``tp`` cannot split this model's experts (lmport.parallel.check_tp says so before any
    worker starts; this guards a model built directly)."""
    size = tp.size if tp is not None else 1
    problem = experts_tp_problem(cfg, size)
    if problem:
        raise ConfigError(f"{cfg.model_type}: tensor parallelism (tp={size}) cannot split this model: {problem}; "
                          f"this model supports tp in {tp_choices(cfg)}")


def expert_range(inter: int, tp: TPGroup) -> tuple[int, int]:
    """[start, end) of this rank's slice of each expert's intermediate dimension (equal slices: tp divides it,
    lmport.parallel.experts_tp_problem)."""
    piece = inter // tp.size
    return tp.rank * piece, (tp.rank + 1) * piece


class Experts(nn.Module):
    """Float experts, run by ``Backend.fused_moe``; a loader replaces them by ``QuantExperts``
    (lmport.models.quantized) where the checkpoint's experts are quantized (under tp: cut to the same slice by
    ``shard_quantized_experts``). Under ``tp`` this rank's slice of every expert's intermediate dimension:
    ``forward`` gives the rank's partial sum, which the block all-reduces."""

    def __init__(self, num_experts: int, hidden: int, inter: int, backend: Backend, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup()
        self.inter, self.shard_range = inter, expert_range(inter, tp)
        part = self.shard_range[1] - self.shard_range[0]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * part, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, part))
        self.backend = backend

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)

    def shard_expert_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full checkpoint tensor ``name``: gate_up_proj [experts, 2 * inter, hidden]
        holds the gate's rows then the up projection's, each sliced alike; down_proj by its input."""
        start, end = self.shard_range
        if name == "gate_up_proj":
            return torch.cat([full[:, start:end], full[:, self.inter + start:self.inter + end]], dim=1)
        return full[:, :, start:end].clone()


def shard_experts(model: PagedCausalLM, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (PagedCausalLM.shard_state_dict's) with every experts module's tensors cut to this rank's slices
    (each module that has a ``shard_expert_tensor(name, full)``); unchanged at tp=1."""
    if model.tp.size == 1:
        return state
    out = dict(state)
    for module_name, module in model.named_modules():
        shard = getattr(module, "shard_expert_tensor", None)
        if not callable(shard):
            continue
        for name, _ in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}"
            if key in out:
                out[key] = shard(name, out[key])
    return out


def shard_quantized_experts(model: PagedCausalLM, quantized: dict, floats: dict[str, torch.Tensor]
                            ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(quantized, floats) as a GGUF or fp8 loader hands them, with every block's stacked quantized experts
    ("<block>.experts.gate_proj" / "up_proj" / "down_proj", [experts x rows, inputs]) cut to this rank's slice of
    each expert's intermediate dimension, as ``Experts.shard_expert_tensor`` cuts float ones: gate and up keep each
    expert's rows [start, end) (whole rows: any type), down its inputs [start, end) (whole blocks of its type;
    lmport.weights.gguf.check_expert_split refuses a tp that cuts one before any weight loads). gpt-oss's gate and
    up biases [experts, inter] go with their rows (its down bias: the model's shard_state_dict). The slices are
    copies: the file's pages under the whole tensors are handed back."""
    if model.tp.size == 1:
        return quantized, floats
    quantized, floats = dict(quantized), dict(floats)
    for name, weight in list(quantized.items()):
        module_name, _, part = name.rpartition(".")
        module = model.get_submodule(module_name) if part in EXPERT_PARTS else None
        shard_range = getattr(module, "shard_range", None)
        if module is None or shard_range is None:
            raise ConfigError(f"{name}: tp={model.tp.size} splits a checkpoint's quantized mixture-of-experts "
                              "weights only; load the others in the compute dtype (weight_format='dequantize')")
        start, end = shard_range
        num_experts = module.get_parameter("gate_up_proj").shape[0]
        if isinstance(weight, Fp8Weight):   # an fp8 checkpoint's, in whole scale blocks (fp8.expert_split_problem)
            quantized[name] = fp8.expert_slice(weight, num_experts, start, end, by_inputs=part == "down_proj")
            continue
        if part == "down_proj":
            quantized[name] = input_range(weight, start, end, name)
            continue
        inter = weight.out_features // num_experts
        rows = (torch.arange(num_experts)[:, None] * inter + torch.arange(start, end)).flatten()
        quantized[name] = _rows(weight, rows)
        bias = f"{name}_bias"
        if bias in floats:
            floats[bias] = floats[bias][:, start:end].clone()
    return quantized, floats


def _rows(weight: QuantizedWeight | GGMLWeight, index: torch.Tensor) -> QuantizedWeight | GGMLWeight:
    picked = weight.rows(index)
    if isinstance(weight, GGMLWeight):
        page_out([weight.blocks])   # copied out of the mapped file
    return picked


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup | None = None):
        super().__init__()
        num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        self.tp = tp or TPGroup()
        self.gate = Router(num_experts, cfg.hidden_size)
        self.experts: nn.Module = Experts(num_experts, cfg.hidden_size, inter, backend, self.tp)
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.backend.linear(x, self.gate.weight)
        weights, ids = route(logits, self.top_k, self.renormalize)
        return self.tp.all_reduce(self.experts.forward(x, weights, ids).contiguous())


def is_sparse_layer(cfg, index: int) -> bool:
    """Whether layer ``index`` has experts (Qwen3-MoE's rule; every Mixtral layer does)."""
    if cfg.model_type == "mixtral":
        return True
    if index in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return cfg.num_experts > 0 and (index + 1) % step == 0


class MoeCausalLM(PagedCausalLM):
    model_types = MOE_MODEL_TYPES

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        refuse_tp(cfg, tp)
        super().__init__(cfg, backend, rotary, tp)
        for i, layer in enumerate(self.model.layers):
            if is_sparse_layer(cfg, i):
                layer.mlp = SparseMoeBlock(cfg, backend, self.tp)

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_experts(self, super().shard_state_dict(full))
