"""Rotary cos/sin by position, from tables that transformers' rotary module fills once.

Transformers computes cos and sin for a step's positions on every call (a matmul, a cat, cos,
sin). Unless the rope type rescales its frequencies with the sequence length ("dynamic" types
and "longrope", which transformers updates per call), a position's row does not depend on the
rest of the step: the module is called once for positions 0..n-1, with n doubling as contexts
grow, and a step gathers its rows.

"longrope" has two sets of frequencies: the short factors while a call's largest position is
below ``original_max_position_embeddings``, the long ones past it. Both are tables, and the step
picks one on the device (no host sync, so a captured CUDA graph holds the choice): the rows are
the module's own for the same positions.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _rope_type(rotary: nn.Module, kind: str | None):
    """The module's rope type for layers of ``kind``, where it keeps one per layer type (Gemma 3's {layer type:
    rope type}); else its one rope type (a dict without ``kind`` stays a dict)."""
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, dict) and kind in rope_type:
        return rope_type[kind]
    return rope_type


def rows_depend_on_length(rotary: nn.Module, kind: str | None = None) -> bool:
    """Whether the module's cos/sin for a position change with the positions it is given; ``kind``: the
    layer type, where the module keeps a rope type per layer type."""
    rope_type = _rope_type(rotary, kind)
    return not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope"


def longrope_switch(rotary: nn.Module, kind: str | None = None) -> int | None:
    """The length past which a "longrope" module takes its long factors; None for other rope types."""
    if _rope_type(rotary, kind) != "longrope":
        return None
    config: Any = rotary.config   # a transformers config (nn.Module types attributes as tensors or modules)
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get(kind, params) if kind else params
    return int(params.get("original_max_position_embeddings") or config.original_max_position_embeddings)


class RopeTable:
    """cos and sin [positions, rotary dim] of one rotary module, for one ``kind`` of layer where the
    module takes one (Gemma 3's layer type; None: it takes none). Not an nn.Module: a cache, never
    saved or moved; it is rebuilt on the device and dtype a step asks for, and holds at most twice
    the longest context seen."""

    MIN_ROWS = 256

    def __init__(self, kind: str | None = None) -> None:
        self.kind = kind
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.short: tuple[torch.Tensor, torch.Tensor] | None = None   # longrope's rows below its switch

    def _call(self, rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor):
        return rotary(x, positions) if self.kind is None else rotary(x, positions, self.kind)

    def __call__(self, rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor,
                 max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions`` (all below ``max_position``, a host int: no device sync)."""
        switch = longrope_switch(rotary, self.kind)
        if switch is not None:
            return self._longrope(rotary, x, positions, max(max_position, switch + 1), switch)
        if rows_depend_on_length(rotary, self.kind):
            cos, sin = self._call(rotary, x, positions[None])
            return cos[0], sin[0]
        return self._rows(rotary, x, positions, max_position)

    def _rows(self, rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor,
              max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos, self.sin
        if cos is None or sin is None or cos.shape[0] < max_position or cos.device != x.device or cos.dtype != x.dtype:
            rows = max(max_position, self.MIN_ROWS, 2 * (0 if cos is None else cos.shape[0]))
            table = self._call(rotary, x, torch.arange(rows, device=x.device)[None])
            cos, sin = self.cos, self.sin = table[0][0], table[1][0]
        return cos[positions], sin[positions]

    def _longrope(self, rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor, max_position: int,
                  switch: int) -> tuple[torch.Tensor, torch.Tensor]:
        long_cos, long_sin = self._rows(rotary, x, positions, max_position)   # a call past the switch: long
        if self.short is None or self.short[0].device != x.device or self.short[0].dtype != x.dtype:
            cos, sin = self._call(rotary, x, torch.arange(switch, device=x.device)[None])
            self.short = cos[0], sin[0]
        below = positions.clamp(max=switch - 1)
        use_long = (positions.max() >= switch)[None, None]
        return (torch.where(use_long, long_cos, self.short[0][below]),
                torch.where(use_long, long_sin, self.short[1][below]))
