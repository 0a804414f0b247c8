"""Tensor parallelism: which tp values a model allows, what each rank holds, and its collectives.

Sharding (Megatron style): q/k/v and gate/up are split by output (column-parallel),
o and down by input (row-parallel, one all-reduce each). Heads split evenly; the MLP
width need not divide by tp (the default model's 1536 over 9 ranks): its pieces differ
by at most one column, which the row-parallel sum does not care about. The embedding and the LM head
are split over the vocabulary: the embedding sums each rank's rows with one all-reduce
(every token's row is on exactly one rank, so the sum is exact), the LM head gathers its
logit columns on rank 0. KV heads are split across ranks; where tp exceeds the KV heads,
each KV head is replicated on tp / num_key_value_heads consecutive ranks. A mixture-of-experts
model's experts are split like the MLP, by their intermediate dimension, in equal slices
(experts_tp_problem says which models and sizes allow it); a GGUF's quantized experts in whole blocks of their
type (lmport.weights.gguf.check_expert_split).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lmport.errors import ConfigError
from lmport.units import ceil_div
from lmport.weights import fp8
from lmport.weights.format import check_quantized_tp


def tp_problem(model_cfg, tp: int) -> str | None:
    """Why ``tp`` cannot split this model (None when it can)."""
    heads, kv = model_cfg.num_attention_heads, model_cfg.num_key_value_heads
    if tp > 1 and model_cfg.model_type in UNSPLIT_LINEAR_ATTENTION_MODEL_TYPES:
        return f"{model_cfg.model_type}'s linear-attention layers are not split over ranks (it runs at tp=1 only)"
    inter = getattr(model_cfg, "intermediate_size", None) or model_cfg.moe_intermediate_size   # MoE-only configs
    if heads % tp:
        return f"its {heads} attention heads are not divisible by tp={tp}"
    if kv % tp and tp % kv:
        return f"its {kv} KV heads neither divide among nor replicate evenly over {tp} ranks"
    if inter < tp:
        return f"its MLP width {inter} is less than tp={tp}"
    return experts_tp_problem(model_cfg, tp)


# The config field that sizes one routed expert's intermediate dimension, for each family whose experts split
# (lmport.models.moe); the families whose experts are not split run at tp=1.
EXPERT_WIDTH_FIELDS = {"mixtral": "intermediate_size", "gpt_oss": "intermediate_size",
                       "qwen3_moe": "moe_intermediate_size", "glm4_moe": "moe_intermediate_size",
                       "deepseek_v3": "moe_intermediate_size"}
UNSHARDED_MOE_MODEL_TYPES = ("llama4_text", "llama4", "qwen3_next")
UNSPLIT_LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def experts_tp_problem(model_cfg, tp: int) -> str | None:
    """Why ``tp`` cannot split this model's experts (None when it can, or the model has none)."""
    if tp == 1:
        return None
    if model_cfg.model_type in UNSHARDED_MOE_MODEL_TYPES:
        return f"{model_cfg.model_type}'s experts are not split over ranks (it runs at tp=1 only)"
    field = EXPERT_WIDTH_FIELDS.get(model_cfg.model_type)
    if field is not None and getattr(model_cfg, field) % tp:
        return f"its experts' intermediate size ({field}={getattr(model_cfg, field)}) is not divisible by tp={tp}"
    return None


def tp_choices(model_cfg) -> list[int]:
    """Every tp this model can be split over."""
    return [n for n in range(1, model_cfg.num_attention_heads + 1) if tp_problem(model_cfg, n) is None]


def check_tp(model_cfg, tp: int) -> None:
    """ConfigError, before any weight loads, when ``tp`` cannot split this model or its weights."""
    problem = tp_problem(model_cfg, tp)
    if problem:
        raise ConfigError(f"tp={tp} cannot split this model: {problem}; "
                          f"this model supports tp in {tp_choices(model_cfg)}")
    # An AWQ / GPTQ config says so itself; a GGUF's quantization is in its tensors (weights.checkpoint).
    quantization = getattr(model_cfg, "quantization_config", None)
    if tp > 1 and model_cfg.model_type in EXPERT_WIDTH_FIELDS and \
            (checkpoint := fp8.from_quantization_config(quantization, "this checkpoint's quantization_config")):
        # An fp8 mixture of experts: its experts split in their scale blocks, its other weights load in the compute
        # dtype and split as float ones do (lmport.weights.fp8.load_tensors).
        check_fp8_expert_split(checkpoint, model_cfg, tp)
        return
    check_quantized_tp(tp, "this checkpoint", bool(quantization), can_dequantize=False)


def check_fp8_expert_split(checkpoint: fp8.Fp8Checkpoint, model_cfg, tp: int) -> None:
    """ConfigError, before any weight loads, where ``tp`` cannot cut the model's routed experts from the checkpoint's
    fp8 experts in whole scale blocks (``fp8.expert_split_problem``), naming the tp values that can and the option
    that loads the experts in the compute dtype instead."""
    field = EXPERT_WIDTH_FIELDS.get(model_cfg.model_type)
    if field is None:
        return
    problem = fp8.expert_split_problem(checkpoint, getattr(model_cfg, field), tp)
    if problem:
        choices = [n for n in tp_choices(model_cfg)
                   if not fp8.expert_split_problem(checkpoint, getattr(model_cfg, field), n)]
        raise ConfigError(f"tp={tp}: {problem}; use tp in {choices}, or weight_format='dequantize' "
                          f"(--weight-format dequantize) to load the experts in the compute dtype")


def kv_heads_per_rank(model_cfg, tp: int) -> int:
    return max(1, model_cfg.num_key_value_heads // tp)


def balanced(size: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's part of ``size`` in tp pieces whose lengths differ by at most one."""
    return rank * size // tp, (rank + 1) * size // tp


def split(size: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's part of ``size`` in ceil(size / tp) pieces (the last ones may be shorter)."""
    piece = ceil_div(size, tp)
    return min(size, rank * piece), min(size, (rank + 1) * piece)


@dataclass
class TPGroup:
    """This rank's place in its tensor-parallel group, and the group's collectives (counted: calls, bytes, seconds)."""

    rank: int = 0
    size: int = 1
    group: object = None                     # a torch.distributed process group when size > 1
    stats: dict = field(default_factory=lambda: {"calls": 0, "bytes": 0, "seconds": 0.0})

    def head_range(self, num_heads: int) -> tuple[int, int]:
        n = num_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        if self.size <= num_kv_heads:
            return self.head_range(num_kv_heads)
        head = self.rank // (self.size // num_kv_heads)      # replicated on size / num_kv_heads ranks
        return head, head + 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            self._count(x, start)
        return x

    def barrier(self) -> None:
        """Returns once every rank of the group has called it."""
        if self.size > 1:
            dist.barrier(group=self.group)

    def gather_columns(self, x: torch.Tensor, width: int, total: int) -> torch.Tensor | None:
        """Rank 0 gets every rank's columns of ``x`` (each padded to ``width``), joined and cut to ``total``."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        self._count(x, start)
        return torch.cat(parts, dim=-1)[..., :total] if self.rank == 0 else None

    def _count(self, x: torch.Tensor, start: float) -> None:
        self.stats["calls"] += 1
        self.stats["bytes"] += x.numel() * x.element_size()
        self.stats["seconds"] += time.perf_counter() - start
