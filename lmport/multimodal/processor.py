"""The model's own image processor (transformers') and its prompt's image placeholders, in the front end.

A chat template writes one placeholder token for each image (Qwen2.5-VL: ``<|image_pad|>`` between
``<|vision_start|>`` and ``<|vision_end|>``); ``prepare`` repeats it as many times as the encoder gives the image
rows, so that every row of the encoder's output has a token position to land on. Idefics3's tiled images:
lmport.multimodal.tiles."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lmport.multimodal.images import ImageError, ImageLimits, check_count, decode, digest
from lmport.multimodal.inputs import ImageInput

# The model types whose images lmport runs (lmport.models.qwen2_vl, lmport.models.qwen3_vl; lmport.models.idefics3,
# whose images are tiled by lmport.multimodal.tiles; lmport.models.mistral3, whose images lmport.multimodal.pixtral
# lays out in rows; lmport.models.gemma3_vl, whose placeholders lmport.multimodal.gemma3 expands;
# lmport.models.llama4_vl, whose images lmport.multimodal.llama4 tiles).
VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "idefics3", "mistral3", "gemma3", "llama4")


def max_image_pixels(directory: Path) -> int | None:
    """The most pixels the directory's image processor resizes an image to, where its ``preprocessor_config.json``
    says (Qwen's ``max_pixels``, or ``size.longest_edge`` beside ``shortest_edge``, as transformers saves it)."""
    try:
        settings = json.loads((directory / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return None
    size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
    pixels = settings.get("max_pixels") or (size.get("longest_edge") if "shortest_edge" in size else None)
    return int(pixels) if isinstance(pixels, (int, float)) and pixels > 0 else None


def takes_images(model: str) -> bool:
    """Whether ``model`` is a transformers directory of a model whose images lmport runs (its config.json read, its
    processor not loaded)."""
    config = Path(model).expanduser() / "config.json"
    try:
        return config.is_file() and json.loads(config.read_text()).get("model_type") in VISION_MODEL_TYPES
    except (OSError, ValueError):
        return False


def placed_images(prompt_ids: list[int], placeholder_id: int, images: list[bytes], limits: ImageLimits,
                  wheres: list[str] | None = None) -> list[tuple[int, object, bytes]]:
    """Each image's placeholder position in the prompt, the image decoded within ``limits``, and its bytes, in prompt
    order (what every family's ``prepare`` starts from). ImageError for an image the limits refuse (``wheres``: each
    image's field in the request) or a prompt whose placeholders do not match the images."""
    wheres = wheres or [f"image {i}" for i in range(len(images))]
    check_count(len(images), limits, "messages")
    decoded = [decode(data, limits, where) for data, where in zip(images, wheres, strict=True)]
    places = [i for i, t in enumerate(prompt_ids) if t == placeholder_id]
    if len(places) != len(decoded):
        raise ImageError(f"messages: the prompt has {len(places)} image placeholders for {len(decoded)} "
                         f"images; the chat template must write one for each image part", "messages")
    return list(zip(places, decoded, images))


class ImageProcessor:
    """Images to a prompt's ``ImageInput`` for one model: its image processor, placeholder token and merge size."""

    def __init__(self, image_processor, image_token_id: int, merge_size: int):
        self.image_processor, self.image_token_id, self.merge_size = image_processor, image_token_id, merge_size

    @classmethod
    def load(cls, path: Path, config: dict) -> ImageProcessor:
        """The processor of the transformers directory ``path`` (its config.json read as ``config``)."""
        from transformers import AutoImageProcessor
        vision = config.get("vision_config") or {}
        return cls(AutoImageProcessor.from_pretrained(path), config["image_token_id"],
                   vision.get("spatial_merge_size", 2))

    def prepare(self, prompt_ids: list[int], images: list[bytes], limits: ImageLimits,
                wheres: list[str] | None = None) -> tuple[list[int], list[ImageInput]]:
        """Decode and process ``images`` (in prompt order) and expand the prompt's placeholders to their token
        counts: the prompt's ids and its images. ImageError for an image the limits refuse (``wheres``: each
        image's field in the request) or a prompt whose placeholders do not match the images."""
        ids: list[int] = []
        inputs: list[ImageInput] = []
        start = 0
        for place, image, data in placed_images(prompt_ids, self.image_token_id, images, limits, wheres):
            ids += prompt_ids[start:place]
            pixels, grid = self.process(image)
            count = grid[0] * grid[1] * grid[2] // self.merge_size ** 2
            inputs.append(ImageInput(len(ids), count, grid, digest(data), pixels))
            ids += [self.image_token_id] * count
            start = place + 1
        return ids + prompt_ids[start:], inputs

    def process(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One image's pixel values [patches, values] (float32) and patch grid (frames, rows, columns)."""
        out = self.image_processor(images=[image], return_tensors="np")
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        return np.asarray(out["pixel_values"], dtype=np.float32), (t, h, w)

