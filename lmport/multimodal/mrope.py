"""Qwen2-VL's multimodal rotary positions (M-RoPE): three position axes (time, row, column) per token.

A text token has the same position on all three axes, one more than the token before it; an image's tokens take
their frame, row and column in the merged grid, offset by the position where the image starts, and the text after
the image resumes at that start plus the image's larger side. The rule is transformers'
``Qwen2_5_VLModel.get_rope_index`` for images (a still image has one frame); tokens generated after the prompt
continue the last text run, which is transformers' ``rope_deltas`` rule."""
from __future__ import annotations

import torch

from lmport.multimodal.inputs import ImageInput


def mrope_positions(images: list[ImageInput], start: int, end: int, merge_size: int) -> torch.Tensor:
    """The [3, end - start] positions of tokens ``start`` to ``end`` of a sequence whose prompt holds ``images``."""
    parts, pos, cursor = [], 0, 0
    for image in sorted(images, key=lambda im: im.offset):
        parts.append(_text(pos, cursor, image.offset, start, end))
        pos += image.offset - cursor
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge_size, image.grid_thw[2] // merge_size
        lo, hi = max(start, image.offset), min(end, image.end)
        if lo < hi:
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            parts.append(grid.reshape(3, -1)[:, lo - image.offset:hi - image.offset] + pos)
        pos += max(h, w)
        cursor = image.end
    parts.append(_text(pos, cursor, max(cursor, end), start, end))
    return torch.cat(parts, dim=1)


def _text(pos: int, first: int, last: int, start: int, end: int) -> torch.Tensor:
    """Positions of the text tokens [first, last) that fall in [start, end), the one at ``first`` being ``pos``."""
    lo, hi = max(first, start), min(last, end)
    return (torch.arange(lo, max(lo, hi)) - first + pos).expand(3, -1)
