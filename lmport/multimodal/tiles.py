"""Tiled images (Idefics3, SmolVLM) in the front end: transformers' own processor cuts each image into tiles plus
a global image and writes the prompt text that stands for it.

The chat template writes one ``<image>`` for each image; the processor's ``replace_image_token`` gives the text
that replaces it (``<fake_token_around_image><row_1_col_1><image>...`` for each tile, then the global image's
``<global-img><image>...``), which is tokenized and spliced into the prompt in its place. Each tile's run of
``<image>`` tokens is one ``ImageInput`` of the engine (its own pixel values, its own encoder rows), so a prompt's
tiles sit on runs of one placeholder token as every image does, and a chunked prefill encodes only the tiles a
step computes."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from lmport.multimodal.images import ImageLimits, digest
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.processor import ImageProcessor, placed_images

TILED_MODEL_TYPES = ("idefics3",)


class TiledImageProcessor(ImageProcessor):
    """Images to a prompt's ``ImageInput`` (one a tile) through transformers' Idefics3 processor."""

    def __init__(self, processor, patch_size: int):
        self.processor, self.patch_size = processor, patch_size
        self.image_processor, self.tokenizer = processor.image_processor, processor.tokenizer
        self.image_token_id = processor.image_token_id
        self.placeholder_id = self.image_token_id   # what the chat template writes for each image: one <image>
        self.texts: dict[tuple[int, int], list[int]] = {}   # the replacement's token ids by (rows, columns)

    @classmethod
    def load(cls, path: Path) -> TiledImageProcessor:
        from transformers import AutoConfig, AutoProcessor
        # through AutoConfig: a config.json may leave out a vision config's default patch size
        return cls(AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path).vision_config.patch_size)

    def prepare(self, prompt_ids: list[int], images: list[bytes], limits: ImageLimits,
                wheres: list[str] | None = None) -> tuple[list[int], list[ImageInput]]:
        ids: list[int] = []
        inputs: list[ImageInput] = []
        start = 0
        for place, image, data in placed_images(prompt_ids, self.placeholder_id, images, limits, wheres):
            ids += prompt_ids[start:place]
            tiles, rows, cols = self.tiles(image)
            replacement = self.replacement(rows, cols)
            runs = image_runs(replacement, self.image_token_id)
            if len(runs) != len(tiles):
                raise ValueError(f"the processor wrote {len(runs)} runs of image tokens for {len(tiles)} tiles")
            name = digest(data)
            for k, ((first, count), tile) in enumerate(zip(runs, tiles)):
                grid = (1, tile.shape[-2] // self.patch_size, tile.shape[-1] // self.patch_size)
                inputs.append(ImageInput(len(ids) + first, count, grid, f"{name}:{k}", tile))
            ids += replacement
            start = place + 1
        return ids + prompt_ids[start:], inputs

    def tiles(self, image) -> tuple[list[np.ndarray], int, int]:
        """One image's tiles, the global image last, each [channels, height, width] float32; and its tile rows and
        columns (0 and 0: not split)."""
        out = self.image_processor(images=[[image]], return_row_col_info=True, return_tensors="np")
        pixels, mask = out["pixel_values"][0], out["pixel_attention_mask"][0]
        if not mask.all():   # one image alone is never padded: each tile fills the encoder's input size
            raise ValueError("the image processor padded a tile of a single image; the encoder takes whole tiles")
        return [np.asarray(p, dtype=np.float32) for p in pixels], int(out["rows"][0][0]), int(out["cols"][0][0])

    def replacement(self, rows: int, cols: int) -> list[int]:
        """The token ids that replace an image's ``<image>`` placeholder: the processor's own text for its tiles."""
        if (rows, cols) not in self.texts:
            text = self.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
            self.texts[rows, cols] = self.tokenizer.encode(text, add_special_tokens=False)
        return self.texts[rows, cols]


def image_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
