"""Which front-end processor runs a model's images: the tiled one (lmport.multimodal.tiles) for Idefics3, the
placeholder-expanding one (lmport.multimodal.processor) otherwise."""
from __future__ import annotations

import json
from pathlib import Path

from lmport.multimodal.processor import ImageProcessor, takes_images
from lmport.multimodal.tiles import TILED_MODEL_TYPES, TiledImageProcessor


def image_processor(model: str) -> ImageProcessor | None:
    """The image processor of a transformers directory whose model takes images; None for any other model."""
    if not takes_images(model):
        return None
    path = Path(model).expanduser()
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") in TILED_MODEL_TYPES:
        return TiledImageProcessor.load(path)
    return ImageProcessor.load(path, config)
