"""Gemma 3's images in the front end, as transformers' ``Gemma3Processor`` writes them.

The chat template writes ``<start_of_image>`` for each image; the processor replaces it with
``\\n\\n<start_of_image>``, ``image_seq_length`` image soft tokens and ``<end_of_image>\\n\\n``, and tokenizes the
whole text. Here the prompt is already token ids, so the replacement is tokenized alone and spliced in its place;
where it meets the prompt, the ordinary tokens on both sides (up to the nearest added token, which the tokenizer
never merges across) are decoded and tokenized again as one text, so that the newlines join what stands beside them
as they do when the processor tokenizes the whole text. The image soft tokens are one ``ImageInput``; the image
processor (transformers' own) resizes every image to the one size the vision tower takes. Pan and scan (extra crops
of large images) is not run."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from lmport.multimodal.images import ImageLimits, digest
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.processor import ImageProcessor, placed_images

GEMMA3_MODEL_TYPES = ("gemma3",)


class Gemma3ImageProcessor(ImageProcessor):
    """Images to a prompt's ``ImageInput`` (one an image, on its run of soft tokens) for a Gemma 3 model."""

    def __init__(self, processor, patch_size: int):
        self.processor, self.patch_size = processor, patch_size
        self.image_processor, self.tokenizer = processor.image_processor, processor.tokenizer
        self.placeholder_id = self.tokenizer.boi_token_id   # what the chat template writes for each image
        self.image_token_id = self.tokenizer.image_token_id
        self.merge_size = 1
        self.added = frozenset(self.tokenizer.added_tokens_decoder)   # ids the tokenizer never merges across
        self.replacement = self.tokenizer.encode(processor.full_image_sequence, add_special_tokens=False)

    @classmethod
    def load(cls, path: Path) -> Gemma3ImageProcessor:
        """The processor of the transformers directory ``path`` (``Gemma3Processor``: its image processor, its
        tokenizer's ``boi_token``, ``image_token`` and ``eoi_token``, its ``image_seq_length``)."""
        from transformers import AutoConfig, AutoProcessor
        config = AutoConfig.from_pretrained(path)
        processor = AutoProcessor.from_pretrained(path)
        tokenizer = processor.tokenizer
        if (token := getattr(tokenizer, "image_token_id", None)) != config.image_token_id:
            raise ValueError(f"{path}: the tokenizer's image_token is token {token}, the model's (config.json "
                             f"image_token_index) is {config.image_token_id}; they must be one token")
        if processor.image_seq_length != config.mm_tokens_per_image:
            raise ValueError(f"{path}: the processor writes {processor.image_seq_length} tokens an image "
                             f"(image_seq_length), the model gives {config.mm_tokens_per_image} "
                             f"(mm_tokens_per_image); they must be equal")
        if getattr(processor.image_processor, "do_pan_and_scan", False):
            raise ValueError(f"{path}: the image processor asks for pan and scan (do_pan_and_scan), which lmport does "
                             f"not run; set it to false in preprocessor_config.json")
        return cls(processor, config.vision_config.patch_size)

    def prepare(self, prompt_ids: list[int], images: list[bytes], limits: ImageLimits,
                wheres: list[str] | None = None) -> tuple[list[int], list[ImageInput]]:
        ids: list[int] = []
        inputs: list[ImageInput] = []
        start = 0
        for place, image, data in placed_images(prompt_ids, self.placeholder_id, images, limits, wheres):
            ids = self.join(ids, prompt_ids[start:place])
            ids = self.join(ids, self.replacement)
            # the soft tokens end the spliced ids but for <end_of_image> and the newlines after it
            end = len(ids) - next(i for i, t in enumerate(reversed(ids)) if t == self.image_token_id)
            count = self.processor.image_seq_length
            pixels = self.pixels(image)
            grid = (1, pixels.shape[-2] // self.patch_size, pixels.shape[-1] // self.patch_size)
            inputs.append(ImageInput(end - count, count, grid, digest(data), pixels))
            start = place + 1
        return self.join(ids, prompt_ids[start:]), inputs

    def pixels(self, image) -> np.ndarray:
        """One image's pixel values [channels, height, width] (float32)."""
        out = self.image_processor(images=[image], do_pan_and_scan=False, return_tensors="np")
        return np.asarray(out["pixel_values"][0], dtype=np.float32)

    def join(self, left: list[int], right: list[int]) -> list[int]:
        """``left`` then ``right``, the ordinary tokens where they meet tokenized again as one text."""
        i = len(left)
        while i > 0 and left[i - 1] not in self.added:
            i -= 1
        j = 0
        while j < len(right) and right[j] not in self.added:
            j += 1
        if i == len(left) or j == 0:   # an added token on one side of the seam: nothing merges across it
            return left + right
        text = "".join(self.tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                       for part in (left[i:], right[:j]))
        return left[:i] + self.tokenizer.encode(text, add_special_tokens=False) + right[j:]
