"""KVLayout: shapes and bytes of the paged KV cache, computed, not allocated.

What a layer caches is data its model declares (``CacheKind``, lmport.models.architectures.cache_kinds): paged
keys and values ("kv": a K and a V tensor of heads x head_dim a token), or a paged latent ("latent", MLA: one
tensor of one "head" of the latent's width a token, DeepSeek-V3's compressed KV and its rotary key side by side).
Both are paged blocks under the same block table, so the block manager, prefix cache and host tier move either
alike; only the number and width of a layer's tensors differ.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmport.kv import quant


CACHE_KINDS = ("kv", "latent")


@dataclass(frozen=True)
class CacheKind:
    """What one layer caches a token: ``kind`` "kv" (a K and a V tensor of ``num_heads`` x ``head_dim``) or
    "latent" (one tensor of ``num_heads`` = 1 x ``head_dim`` = the latent's width)."""

    kind: str
    num_heads: int
    head_dim: int

    def __post_init__(self):
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {', '.join(CACHE_KINDS)}, got {self.kind!r}")
        if self.kind == "latent" and self.num_heads != 1:
            raise ValueError(f"a latent cache holds one head a token, got {self.num_heads}")

    @property
    def num_tensors(self) -> int:
        return 2 if self.kind == "kv" else 1


@dataclass
class LayerCache:
    """One layer's cache blocks (and their quantization params), in the axis order of its layout:
    "bshd" = [block, slot, head, last], "bhsd" = [block, head, slot, last]. A "latent" layer (MLA) keeps its
    latent in ``k`` ([block, slot, 1, width]); its ``v`` and ``v_qparams`` are None."""

    k: torch.Tensor
    v: torch.Tensor | None
    k_qparams: torch.Tensor | None
    v_qparams: torch.Tensor | None
    quant_policy: int | str   # 0, 8, 4 or "fp8" (lmport.kv.quant.POLICIES)
    block_size: int
    axis_order: str = "bshd"
    kind: str = "kv"
    # quant_policy "fp8": the float32 scale of each KV head [heads] (lmport.kv.quant.quantize_fp8); None otherwise.
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def require_axis_order(self, order: str, op: str) -> None:
        """Refuse a cache in an order ``op`` does not handle (a backend with another order overrides the op)."""
        if self.axis_order != order:
            raise ValueError(f"{op} handles {order!r} KV caches, not {self.axis_order!r}: a backend whose "
                             f"capabilities declare kv_axis_order={self.axis_order!r} must override {op}")


@dataclass(frozen=True)
class KVLayout:
    """``num_kv_heads`` x ``head_dim``: every layer's paged K/V, unless ``layer_kinds`` names each layer's kind
    (a model's cache_kinds); then those, and the two fields are the first layer's."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    quant_policy: int | str = 0
    axis_order: str = "bshd"
    layer_kinds: tuple[CacheKind, ...] = ()

    def __post_init__(self):
        if self.quant_policy not in quant.POLICIES:
            raise ValueError(f"quant_policy must be 0, 4, 8 or 'fp8', got {self.quant_policy!r}")
        if self.axis_order not in ("bshd", "bhsd"):
            raise ValueError(f"axis_order must be 'bshd' or 'bhsd', got {self.axis_order!r}")
        if self.layer_kinds and len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for {self.num_layers} layers")
        for kind in self.kinds:
            quant.packed_dim(kind.head_dim, self.quant_policy)

    @property
    def kinds(self) -> tuple[CacheKind, ...]:
        """Each layer's cache kind."""
        return self.layer_kinds or (CacheKind("kv", self.num_kv_heads, self.head_dim),) * self.num_layers

    @property
    def value_dtype(self) -> torch.dtype:
        if quant.is_fp8(self.quant_policy):
            return quant.FP8_DTYPE
        return torch.uint8 if self.quant_policy else self.dtype

    @property
    def param_dtype(self) -> torch.dtype | None:
        return quant.param_dtype(self.dtype) if quant.has_codes(self.quant_policy) else None

    def _block_shape(self, last: int, heads: int | None = None) -> tuple[int, int, int]:
        heads = self.num_kv_heads if heads is None else heads
        if self.axis_order == "bshd":
            return (self.block_size, heads, last)
        return (heads, self.block_size, last)

    @property
    def value_block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of K (or V) values for one layer (the first layer's, where kinds differ)."""
        return self.kind_value_block_shape(self.kinds[0])

    @property
    def qparam_block_shape(self) -> tuple[int, int, int] | None:
        """Shape of one block of (scale, zero) pairs, None when unquantized."""
        return self.kind_qparam_block_shape(self.kinds[0])

    def kind_value_block_shape(self, kind: CacheKind) -> tuple[int, int, int]:
        return self._block_shape(quant.packed_dim(kind.head_dim, self.quant_policy), kind.num_heads)

    def kind_qparam_block_shape(self, kind: CacheKind) -> tuple[int, int, int] | None:
        return self._block_shape(2, kind.num_heads) if quant.has_codes(self.quant_policy) else None

    def kind_bytes_per_block(self, kind: CacheKind) -> int:
        """One layer of ``kind``: its tensors (K and V, or the latent), values plus quantization params."""
        def numel(shape):
            n = 1
            for s in shape:
                n *= s
            return n
        per_tensor = numel(self.kind_value_block_shape(kind)) * self.value_dtype.itemsize
        if quant.has_codes(self.quant_policy):   # fp8's scale is per head and layer, not per block
            per_tensor += numel(self.kind_qparam_block_shape(kind)) * self.param_dtype.itemsize
        return kind.num_tensors * per_tensor

    @property
    def bytes_per_block(self) -> int:
        """All layers, each its kind's tensors (K and V, or the latent), values plus quantization params."""
        return sum(self.kind_bytes_per_block(kind) for kind in self.kinds)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def blocks_in(self, budget_bytes: int) -> int:
        return max(0, int(budget_bytes) // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device | str, *, pin_memory: bool = False) -> list[LayerCache]:
        """Zero-filled caches: padded table entries read finite values, never NaN."""
        def zeros(block_shape, dtype):
            t = torch.zeros((num_blocks, *block_shape), dtype=dtype, device=device)
            return t.pin_memory() if pin_memory else t

        caches = []
        for kind in self.kinds:
            values, qp = self.kind_value_block_shape(kind), self.kind_qparam_block_shape(kind)
            paired = kind.num_tensors == 2
            caches.append(LayerCache(
                k=zeros(values, self.value_dtype),
                v=zeros(values, self.value_dtype) if paired else None,
                k_qparams=zeros(qp, self.param_dtype) if qp else None,
                v_qparams=zeros(qp, self.param_dtype) if qp and paired else None,
                quant_policy=self.quant_policy,
                block_size=self.block_size,
                axis_order=self.axis_order,
                kind=kind.kind,
                **self._fp8_scales(kind, paired, device),
            ))
        return caches

    def _fp8_scales(self, kind: CacheKind, paired: bool, device) -> dict:
        """An fp8 cache's per-head scales: 1.0 (vLLM's default without calibration)."""
        if not quant.is_fp8(self.quant_policy):
            return {}
        ones = torch.ones(kind.num_heads, dtype=torch.float32, device=device)
        return {"k_scale": ones, "v_scale": ones.clone() if paired else None}
