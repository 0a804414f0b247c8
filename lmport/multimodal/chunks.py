"""Where a prefill chunk may end for a model whose image tokens attend to each other both ways (Gemma 3,
lmport.models.gemma3_vl): never inside an image, since a token computed in one step cannot see keys computed in a
later one. The scheduler asks it for each prompt chunk (Scheduler.whole_images)."""
from __future__ import annotations

from lmport.multimodal.inputs import ImageInput


def whole_image_chunk(images: list[ImageInput], start: int, tokens: int, room: int, step_tokens: int) -> int:
    """The tokens a prefill chunk of ``tokens`` from position ``start`` computes so that it ends inside no image:
    ``tokens`` where it ends outside every image; the tokens before the image it would end inside, where that image
    starts after ``start``; otherwise (the chunk starts at or inside that image) the rest of the image where it fits
    in ``room`` (the step's tokens left), else 0: the chunk waits for a step with room. An image larger than a whole
    step (``step_tokens``, max_prefill_token_num) cannot be kept whole: ``tokens``, and the model refuses the step
    naming max_prefill_token_num."""
    end = start + tokens
    for image in images:
        if image.offset < end < image.end:
            if image.offset > start:
                return image.offset - start
            rest = image.end - start
            return tokens if rest > step_tokens else rest if rest <= room else 0
    return tokens
