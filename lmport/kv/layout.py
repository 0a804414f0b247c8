"""KVLayout: shapes and bytes of the paged KV cache, computed, not allocated."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmport.kv import quant


@dataclass
class LayerCache:
    """One layer's K and V cache blocks (and their quantization params), in the axis order of its layout:
    "bshd" = [block, slot, head, last], "bhsd" = [block, head, slot, last]."""

    k: torch.Tensor
    v: torch.Tensor
    k_qparams: torch.Tensor | None
    v_qparams: torch.Tensor | None
    quant_policy: int
    block_size: int
    axis_order: str = "bshd"

    def require_axis_order(self, order: str, op: str) -> None:
        """Refuse a cache in an order ``op`` does not handle (a backend with another order overrides the op)."""
        if self.axis_order != order:
            raise ValueError(f"{op} handles {order!r} KV caches, not {self.axis_order!r}: a backend whose "
                             f"capabilities declare kv_axis_order={self.axis_order!r} must override {op}")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    quant_policy: int = 0
    axis_order: str = "bshd"

    def __post_init__(self):
        if self.quant_policy not in (0, 4, 8):
            raise ValueError(f"quant_policy must be 0, 4 or 8, got {self.quant_policy}")
        if self.axis_order not in ("bshd", "bhsd"):
            raise ValueError(f"axis_order must be 'bshd' or 'bhsd', got {self.axis_order!r}")
        quant.packed_dim(self.head_dim, self.quant_policy)

    @property
    def value_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quant_policy else self.dtype

    @property
    def param_dtype(self) -> torch.dtype | None:
        return quant.param_dtype(self.dtype) if self.quant_policy else None

    def _block_shape(self, last: int) -> tuple[int, int, int]:
        if self.axis_order == "bshd":
            return (self.block_size, self.num_kv_heads, last)
        return (self.num_kv_heads, self.block_size, last)

    @property
    def value_block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of K (or V) values for one layer."""
        return self._block_shape(quant.packed_dim(self.head_dim, self.quant_policy))

    @property
    def qparam_block_shape(self) -> tuple[int, int, int] | None:
        """Shape of one block of (scale, zero) pairs, None when unquantized."""
        return self._block_shape(2) if self.quant_policy else None

    @property
    def bytes_per_block(self) -> int:
        """All layers, K and V, values plus quantization params."""
        def numel(shape):
            n = 1
            for s in shape:
                n *= s
            return n
        per_tensor = numel(self.value_block_shape) * self.value_dtype.itemsize
        if self.quant_policy:
            per_tensor += numel(self.qparam_block_shape) * self.param_dtype.itemsize
        return 2 * self.num_layers * per_tensor

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
        for _ in range(self.num_layers):
            qp = self.qparam_block_shape
            caches.append(LayerCache(
                k=zeros(self.value_block_shape, self.value_dtype),
                v=zeros(self.value_block_shape, self.value_dtype),
                k_qparams=zeros(qp, self.param_dtype) if qp else None,
                v_qparams=zeros(qp, self.param_dtype) if qp else None,
                quant_policy=self.quant_policy,
                block_size=self.block_size,
                axis_order=self.axis_order,
            ))
        return caches
