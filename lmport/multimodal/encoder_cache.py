"""The vision encoder's output rows by image digest, kept for images whose tokens may be computed again (a split
prefill, a preemption): at most ``rows`` rows, the least recently used dropped first."""
from __future__ import annotations

from collections import OrderedDict

import torch

ENCODER_CACHE_ROWS = 16384


class EncoderCache:
    def __init__(self, rows: int = ENCODER_CACHE_ROWS):
        self.rows, self.held, self.entries = rows, 0, OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        out = self.entries.get(key)
        if out is not None:
            self.entries.move_to_end(key)
        return out

    def put(self, key: str, rows: torch.Tensor) -> None:
        if key in self.entries or len(rows) > self.rows:
            return
        while self.held + len(rows) > self.rows:
            self.held -= len(self.entries.popitem(last=False)[1])
        self.entries[key] = rows
        self.held += len(rows)
