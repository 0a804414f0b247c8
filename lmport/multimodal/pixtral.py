"""Pixtral's images (Mistral 3: Mistral Small 3.1 and 3.2) in the front end, as transformers' ``PixtralProcessor``
writes them.

The image processor (transformers' own) resizes each image so that its longest side fits the processor's
``longest_edge`` and each side is a multiple of one merged cell (the vision patch size times the spatial merge size),
keeping its aspect ratio. The chat template writes one ``[IMG]`` for each image; it is replaced by a row of
``[IMG]`` for each row of merged cells, each row ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]``. Only the
``[IMG]`` tokens take the encoder's rows, so an image is one ``ImageInput`` whose ``span`` covers its breaks and end
too (the encoder attends over the whole image: its rows cannot be computed a row of cells at a time)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lmport.multimodal.images import ImageLimits, digest
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.processor import ImageProcessor, placed_images

PIXTRAL_MODEL_TYPES = ("mistral3",)


class PixtralImageProcessor(ImageProcessor):
    """Images to a prompt's ``ImageInput`` (one an image, on its rows of ``[IMG]`` and their breaks) for a Mistral 3
    model."""

    def __init__(self, image_processor, image_token_id: int, break_token_id: int, end_token_id: int,
                 patch_size: int, merge_size: int):
        super().__init__(image_processor, image_token_id, merge_size)
        self.break_token_id, self.end_token_id, self.patch_size = break_token_id, end_token_id, patch_size

    @classmethod
    def load(cls, path: Path) -> PixtralImageProcessor:
        """The processor of the transformers directory ``path``: its image processor, the patch size, merge size and
        token names of its ``processor_config.json`` (as ``PixtralProcessor`` reads them; the model's config where it
        has none), the tokens' ids from its tokenizer."""
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
        config = AutoConfig.from_pretrained(path)
        settings_file = path / "processor_config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        tokenizer = AutoTokenizer.from_pretrained(path)
        names = [settings.get(key, default) for key, default in (("image_token", "[IMG]"),
                                                                  ("image_break_token", "[IMG_BREAK]"),
                                                                  ("image_end_token", "[IMG_END]"))]
        ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
        for name, token_id in zip(names, ids):
            if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != name:
                raise ValueError(f"{path}: the tokenizer has no {name} token; Mistral 3's images need "
                                 f"{', '.join(names)} as tokens of its vocabulary")
        if ids[0] != config.image_token_id:
            raise ValueError(f"{path}: the tokenizer's {names[0]} is token {ids[0]}, the model's image token "
                             f"(config.json image_token_index) is {config.image_token_id}; they must be one token")
        return cls(AutoImageProcessor.from_pretrained(path), *ids,
                   settings.get("patch_size", config.vision_config.patch_size),
                   settings.get("spatial_merge_size", config.spatial_merge_size))

    @property
    def cell(self) -> int:
        """The pixels a side of one merged cell (one ``[IMG]`` token) covers."""
        return self.patch_size * self.merge_size

    def prepare(self, prompt_ids: list[int], images: list[bytes], limits: ImageLimits,
                wheres: list[str] | None = None) -> tuple[list[int], list[ImageInput]]:
        ids: list[int] = []
        inputs: list[ImageInput] = []
        start = 0
        for place, image, data in placed_images(prompt_ids, self.image_token_id, images, limits, wheres):
            ids += prompt_ids[start:place]
            pixels = self.resized(image)
            rows, cols = pixels.shape[1] // self.cell, pixels.shape[2] // self.cell
            layout = ([self.image_token_id] * cols + [self.break_token_id]) * rows
            layout[-1] = self.end_token_id
            grid = (1, pixels.shape[1] // self.patch_size, pixels.shape[2] // self.patch_size)
            inputs.append(ImageInput(len(ids), rows * cols, grid, digest(data), pixels, span=len(layout)))
            ids += layout
            start = place + 1
        return ids + prompt_ids[start:], inputs

    def resized(self, image) -> np.ndarray:
        """One image's pixel values [channels, height, width] (float32), resized to whole merged cells."""
        out = self.image_processor(images=[image], patch_size=self.cell, return_tensors="np")
        height, width = (int(v) for v in out["image_sizes"][0])
        if height % self.cell or width % self.cell:
            raise ValueError(f"the image processor gave a {height} x {width} image, not whole {self.cell}-pixel "
                             f"cells; its patch size must be the processor's patch_size times spatial_merge_size")
        return np.asarray(out["pixel_values"][0][:, :height, :width], dtype=np.float32)
