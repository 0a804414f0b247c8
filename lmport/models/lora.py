"""LoRA layers: each targeted linear of the model holds every loaded adapter's A and B, stacked by slot.

``attach_lora`` wraps, in every decoder layer, the linears an adapter may target (q, k, v, o, gate, up,
down) in a ``LoraLinear``; after loading, q/k/v and gate/up are one merged linear (models/fusion.py),
so one ``LoraLinear`` serves the parts of a merged one. Its buffers are

    lora_a  [max_loras, parts * max_rank, in]    part p's A in rows [p * max_rank, p * max_rank + r)
    lora_b  [max_loras, out, parts * max_rank]   part p's B in its output rows and part p's rank columns

so B is block diagonal over the parts and one matmul pair serves q, k and v at once: each part reads
its own A's output only. The adapter's scaling (lora_alpha / r) is folded into B when it is loaded; a
slot's unused rows and columns stay zero. A step's rows pick their slot through the ``LoraState``
every wrapped linear shares: the runner sets its batch (lmport.ops.lora) before the forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmport.platform.backend import Backend
from lmport.errors import ConfigError
from lmport.models.dims import head_dim_of
from lmport.models.llama import MLP, Attention, PagedCausalLM
from lmport.ops import LoraBatch

# The modules an adapter may target, as peft names them in a Llama-family model.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_TARGETS + MLP_TARGETS
LORA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class TargetShape:
    """One wrapped linear: its input features and its parts' output features, in row order."""

    in_features: int
    parts: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.parts)


def layer_targets(cfg) -> dict[str, TargetShape]:
    """The wrapped linears of one decoder layer (at tp=1), by the attribute that holds them once merged."""
    d, hidden, inter = head_dim_of(cfg), cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {
        "self_attn.qkv_proj": TargetShape(hidden, (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
        "self_attn.o_proj": TargetShape(q, (("o_proj", hidden),)),
        "mlp.gate_up_proj": TargetShape(hidden, (("gate_proj", inter), ("up_proj", inter))),
        "mlp.down_proj": TargetShape(inter, (("down_proj", hidden),)),
    }


def lora_bytes(cfg, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Bytes of the adapter buffers ``attach_lora`` allocates (0 when max_loras is 0)."""
    per_layer = sum(len(t.parts) * max_rank * (t.in_features + t.out_features) for t in layer_targets(cfg).values())
    return max_loras * cfg.num_hidden_layers * per_layer * dtype.itemsize


class LoraState:
    """The step's rows by adapter slot, shared by every LoraLinear of a model; None: no row uses one."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraLinear(nn.Module):
    """A linear (of any kind, merged or not) plus each row's adapter update."""

    lora_a: torch.Tensor   # buffers (registered in __init__)
    lora_b: torch.Tensor

    def __init__(self, base: nn.Module, shape: TargetShape, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, backend: Backend, state: LoraState):
        super().__init__()
        self.base, self.shape, self.max_rank = base, shape, max_rank
        self.backend, self.state = backend, state
        rank = len(shape.parts) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, rank, shape.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, shape.out_features, rank, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.forward(x)
        batch = self.state.batch
        return y if batch is None else self.backend.add_lora(y, x, self.lora_a, self.lora_b, batch)

    @torch.no_grad()
    def set_slot(self, slot: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds these parts' (A [r, in], B [out, r] with the scaling folded in); others zero."""
        a, b = torch.zeros_like(self.lora_a[slot]), torch.zeros_like(self.lora_b[slot])
        row = 0
        for p, (name, n) in enumerate(self.shape.parts):
            if name in parts:
                pa, pb = parts[name]
                r = pa.shape[0]
                a[p * self.max_rank:p * self.max_rank + r] = pa
                b[row:row + n, p * self.max_rank:p * self.max_rank + r] = pb
            row += n
        self.lora_a[slot].copy_(a)
        self.lora_b[slot].copy_(b)


class LoraLayers:
    """The LoraLinears of a model by peft module name ("layers.3.self_attn.q_proj"), and their shared state."""

    def __init__(self, model: PagedCausalLM, max_loras: int, max_rank: int, dtype: torch.dtype):
        cfg = model.config
        if cfg.model_type not in LORA_MODEL_TYPES or model.tp.size > 1:
            raise ConfigError(f"LoRA adapters run on {', '.join(LORA_MODEL_TYPES)} models at tp=1, not on "
                              f"{cfg.model_type} at tp={model.tp.size}; use max_loras=0")
        self.state = LoraState()
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets: dict[str, tuple[LoraLinear, str]] = {}   # peft module name -> (its LoraLinear, part name)
        self.shapes: dict[str, tuple[int, int]] = {}           # peft module name -> (in, out)
        self.bytes = 0
        device = model.backend.device
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn) is not Attention or type(mlp) is not MLP:
                raise ConfigError(f"LoRA adapters need the Llama-family layer; layer {i} of {cfg.model_type} "
                                  f"is not one; use max_loras=0")
            for path, shape in layer_targets(cfg).items():
                owner_name, attr = path.split(".")
                owner = attn if owner_name == "self_attn" else mlp
                if getattr(owner, attr, None) is None:   # not merged: each part wrapped alone
                    wrapped = [(name, TargetShape(shape.in_features, ((name, n),))) for name, n in shape.parts]
                else:
                    wrapped = [(attr, shape)]
                for name, part_shape in wrapped:
                    lora = LoraLinear(getattr(owner, name), part_shape, max_loras, max_rank, dtype, device,
                                      model.backend, self.state)
                    setattr(owner, name, lora)
                    self.bytes += lora.lora_a.nbytes + lora.lora_b.nbytes
                    for part, n in part_shape.parts:
                        key = f"layers.{i}.{owner_name}.{part}"
                        self.targets[key] = (lora, part)
                        self.shapes[key] = (part_shape.in_features, n)

    def load(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds these modules' (A, B) (peft module name -> tensors, scaling folded into B);
        every other module's update in that slot is zero."""
        by_linear: dict[LoraLinear, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for key, (lora, part) in self.targets.items():
            parts = by_linear.setdefault(lora, {})
            if key in weights:
                parts[part] = weights[key]
        for lora, parts in by_linear.items():
            lora.set_slot(slot, parts)

    def clear(self, slot: int) -> None:
        self.load(slot, {})
