"""LoRA over a batch that mixes adapters: each row adds its own adapter's low-rank update.

Every LoRA-wrapped linear holds the adapters' weights stacked by slot (lmport.models.lora):
``lora_a`` [L, R, in] and ``lora_b`` [L, out, R], the adapter's scaling already folded into B, a
slot's unused rank rows zero. Row t of a step belongs to slot ``slots[t]`` (-1: the base model,
no update), and gets ``y[t] + lora_b[s] @ (lora_a[s] @ x[t])``.

``LoraBatch`` is built once a step by a pure function from the sequences' slots, like the attention
metadata. Besides each row's slot it holds the rows grouped by slot two ways, so a backend runs each
adapter's rows as one matmul pair without reading a device tensor back: ``rows_by_slot`` (one index
tensor a slot in use) and ``tile_rows``/``tile_slots`` (the same rows in tiles of ``LORA_TILE``, each
slot's run padded with -1, and the slot of each tile: a grouped GEMM's work list).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


LORA_TILE = 16


@dataclass(frozen=True)
class LoraBatch:
    slots: torch.Tensor                                  # [T] int64, each row's slot, -1 for the base model
    rows_by_slot: tuple[tuple[int, torch.Tensor], ...]   # (slot, its rows [n] int64) for each slot in use
    tile_rows: torch.Tensor                              # [tiles * LORA_TILE] int64, rows by slot, -1 padding
    tile_slots: torch.Tensor                             # [tiles] int32, the slot of each tile

    @property
    def num_tokens(self) -> int:
        return self.slots.shape[0]


def build_lora_batch(q_lens: list[int], seq_slots: list[int], device: torch.device | str = "cpu") -> LoraBatch | None:
    """The step's LoRA rows from each sequence's new-token count and slot; None when no row uses an adapter."""
    if len(q_lens) != len(seq_slots):
        raise ValueError(f"one slot per sequence: {len(seq_slots)} slots for {len(q_lens)} sequences")
    if all(s < 0 for s in seq_slots):
        return None
    slots: list[int] = []
    rows: dict[int, list[int]] = {}
    for n, slot in zip(q_lens, seq_slots):
        if slot >= 0:
            rows.setdefault(slot, []).extend(range(len(slots), len(slots) + n))
        slots.extend([slot] * n)

    tile_rows: list[int] = []
    tile_slots: list[int] = []
    for slot, r in sorted(rows.items()):
        tiles = -(-len(r) // LORA_TILE)
        tile_rows += r + [-1] * (tiles * LORA_TILE - len(r))
        tile_slots += [slot] * tiles

    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return LoraBatch(tensor(slots), tuple((s, tensor(r)) for s, r in sorted(rows.items())),
                     tensor(tile_rows), tensor(tile_slots, torch.int32))


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             batch: LoraBatch) -> torch.Tensor:
    """``y`` [T, out] plus each row's adapter update, computed row by row in float32 (the reference)."""
    out = y.float().clone()
    for t, slot in enumerate(batch.slots.tolist()):
        if slot >= 0:
            out[t] += lora_b[slot].float() @ (lora_a[slot].float() @ x[t].float())
    return out.to(y.dtype)
