"""The vision encoder's output rows by image digest, kept for images whose tokens may be computed again (a split
prefill, a preemption): at most ``rows`` rows, the least recently used dropped first; each image's rows in a
storage of their own, so the rows held bound the memory held (the memory plan reserves them:
lmport.memory.budget.encoder_cache_reserve)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from lmport.multimodal.inputs import ImageInput

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
        if rows.untyped_storage().nbytes() != rows.numel() * rows.element_size():
            rows = rows.clone()   # a view of a call's whole output would keep all of it: hold its own rows only
        while self.held + len(rows) > self.rows:
            self.held -= len(self.entries.popitem(last=False)[1])
        self.entries[key] = rows
        self.held += len(rows)

    def rows_of(self, images: list[ImageInput], encode: Callable[[list[ImageInput]], list[torch.Tensor]]
                ) -> dict[str, torch.Tensor]:
        """Each image's encoder rows by digest: those held here, the others from one ``encode(images)`` call (each
        image once, with its pixel values), kept for next time."""
        out = {im.digest: rows for im in images if (rows := self.get(im.digest)) is not None}
        todo = list({im.digest: im for im in images if im.digest not in out}.values())
        if todo:
            if any(im.pixel_values is None for im in todo):
                raise ValueError("an image's tokens are computed without its pixel values")
            for im, rows in zip(todo, encode(todo), strict=True):
                out[im.digest] = rows
                self.put(im.digest, rows)
        return out
