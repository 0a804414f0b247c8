"""Fixed-size recurrent-state slots: what a linear-attention layer (Qwen3-Next's Gated DeltaNet) keeps of a
sequence instead of paged K/V.

Each running sequence holds one slot from admission to its end (finish, abort, or preemption: preemption by
recompute drops the state, and the sequence's prefill rebuilds it). A slot holds, for every linear layer, the
conv window ([conv channels, kernel - 1], in the model's dtype) and the recurrent state of each value head
([heads, key dim, value dim], float32: it is the sum of every token's update, so it is kept at the precision
the rule computes in). Its bytes are fixed by the model config, whatever the sequence's length, so the memory
plan reserves ``max_batch_size`` slots beside the paged cache.

``StatePool`` is the host-side accounting (which sequence holds which slot); ``StateTensors`` the device
storage the model reads and writes through the slot ids a step hands it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentStateSpec:
    """One sequence's recurrent state: ``num_layers`` linear layers, each a conv window and a state matrix."""

    num_layers: int
    conv_channels: int
    conv_width: int      # kernel - 1: the inputs before the next token that its convolution reads
    num_heads: int
    key_dim: int
    value_dim: int
    conv_dtype: torch.dtype
    state_dtype: torch.dtype = torch.float32

    @property
    def conv_bytes_per_layer(self) -> int:
        return self.conv_channels * self.conv_width * self.conv_dtype.itemsize

    @property
    def state_bytes_per_layer(self) -> int:
        return self.num_heads * self.key_dim * self.value_dim * self.state_dtype.itemsize

    @property
    def bytes_per_sequence(self) -> int:
        return self.num_layers * (self.conv_bytes_per_layer + self.state_bytes_per_layer)


class NoFreeStateSlot(RuntimeError):
    pass


class StatePool:
    """``num_slots`` slots, each held by at most one sequence at a time (the scheduler's Sequence objects, or
    any hashable key)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a recurrent-state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))   # popped from the end: slot 0 first
        self.holders: dict[object, int] = {}                   # sequence id -> its slot

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def can_allocate(self, count: int = 1) -> bool:
        return len(self.free_slots) >= count

    def allocate(self, seq_id) -> int:
        """A free slot for ``seq_id``, which must hold none; NoFreeStateSlot when every slot is held."""
        if seq_id in self.holders:
            raise ValueError(f"sequence {seq_id!r} already holds state slot {self.holders[seq_id]}")
        if not self.free_slots:
            raise NoFreeStateSlot(f"all {self.num_slots} recurrent-state slots are held; admit the sequence "
                                  f"once one finishes")
        slot = self.free_slots.pop()
        self.holders[seq_id] = slot
        return slot

    def slot_of(self, seq_id) -> int:
        return self.holders[seq_id]

    def holds(self, seq_id) -> bool:
        return seq_id in self.holders

    def free(self, seq_id) -> None:
        """Returns ``seq_id``'s slot to the pool; a sequence holding none is left as it is (an abort of a
        sequence never admitted, a second free)."""
        slot = self.holders.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def check_invariants(self) -> None:
        """Every slot is either free or held by exactly one sequence, never both, never twice."""
        held = list(self.holders.values())
        if len(set(held)) != len(held):
            raise AssertionError("a state slot is held by two sequences")
        if len(set(self.free_slots)) != len(self.free_slots):
            raise AssertionError("a state slot is free twice")
        if set(held) & set(self.free_slots):
            raise AssertionError("a held state slot is also free")
        if sorted(held + self.free_slots) != list(range(self.num_slots)):
            raise AssertionError("a state slot is neither free nor held (leaked), or out of range")


class StateTensors:
    """The device storage of ``num_slots`` slots: per linear layer, conv windows [slots, channels, width] and
    states [slots, heads, key dim, value dim]."""

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, device: torch.device | str):
        self.spec, self.num_slots = spec, num_slots
        self.conv = [torch.zeros(num_slots, spec.conv_channels, spec.conv_width, dtype=spec.conv_dtype, device=device)
                     for _ in range(spec.num_layers)]
        self.state = [torch.zeros(num_slots, spec.num_heads, spec.key_dim, spec.value_dim, dtype=spec.state_dtype,
                                  device=device) for _ in range(spec.num_layers)]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.state))
