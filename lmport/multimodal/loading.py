"""Which front-end processor runs a model's images: the tiled one (lmport.multimodal.tiles) for Idefics3, the
row-laying one (lmport.multimodal.pixtral) for Mistral 3, Gemma 3's (lmport.multimodal.gemma3), Llama 4's tiles
(lmport.multimodal.llama4), the placeholder-expanding one (lmport.multimodal.processor) otherwise; for a GGUF text
model served with an mmproj file, the one its metadata sizes (lmport.multimodal.mmproj)."""
from __future__ import annotations

import json
from pathlib import Path

from lmport.multimodal.gemma3 import GEMMA3_MODEL_TYPES, Gemma3ImageProcessor
from lmport.multimodal.llama4 import LLAMA4_MODEL_TYPES, Llama4ImageProcessor
from lmport.multimodal.pixtral import PIXTRAL_MODEL_TYPES, PixtralImageProcessor
from lmport.multimodal.processor import ImageProcessor
from lmport.multimodal.processor import takes_images as directory_takes_images
from lmport.multimodal.tiles import TILED_MODEL_TYPES, TiledImageProcessor


def takes_images(model: str, mmproj: str | None = None) -> bool:
    """Whether ``model`` takes images: a transformers directory of a vision-language model lmport runs, or a GGUF
    text model served with its ``mmproj`` file (which the engine checked as it loaded)."""
    return mmproj is not None or directory_takes_images(model)


def image_processor(model: str, mmproj: str | None = None) -> ImageProcessor | None:
    """The image processor of a transformers directory whose model takes images, or of a GGUF text model and its
    mmproj file (lmport.multimodal.mmproj); None for any other model."""
    if mmproj is not None:
        from lmport.models.loader import resolve_model_path
        from lmport.multimodal.mmproj import image_processor as mmproj_image_processor
        return mmproj_image_processor(resolve_model_path(model), Path(mmproj).expanduser())
    if not directory_takes_images(model):
        return None
    path = Path(model).expanduser()
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") in TILED_MODEL_TYPES:
        return TiledImageProcessor.load(path)
    if config.get("model_type") in PIXTRAL_MODEL_TYPES:
        return PixtralImageProcessor.load(path)
    if config.get("model_type") in GEMMA3_MODEL_TYPES:
        return Gemma3ImageProcessor.load(path)
    if config.get("model_type") in LLAMA4_MODEL_TYPES:
        return Llama4ImageProcessor.load(path)
    return ImageProcessor.load(path, config)
