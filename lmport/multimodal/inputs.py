"""An image as the engine carries it: where its placeholder tokens sit in the prompt, the grid its tokens cover,
a digest of its bytes, and the pixel values the model's image processor made of it.

Plain values (numpy, no torch) so that it crosses from the HTTP front end to the engine core as msgpack
(lmport.engine.messages: the pixel values as their float32 bytes)."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageInput:
    offset: int                         # index in the prompt of the image's first placeholder token
    num_tokens: int                     # its placeholder tokens (the encoder's output rows)
    grid_thw: tuple[int, int, int]      # the patch grid (frames, rows, columns) before the encoder's merge
    digest: str                         # of the image's bytes (lmport.multimodal.images.digest)
    pixel_values: np.ndarray | None = None   # [patches, patch values] float32; None where only the layout is needed
    # the prompt tokens it covers where other tokens sit among its placeholders (Pixtral's row breaks and end:
    # lmport.multimodal.pixtral); None: its placeholder tokens alone
    span: int | None = None

    @property
    def end(self) -> int:
        return self.offset + (self.num_tokens if self.span is None else self.span)

    def layout_only(self) -> ImageInput:
        return dataclasses.replace(self, pixel_values=None)


def images_key(images: list[ImageInput]) -> str:
    """What a prompt's images add to its prefix-cache key: each image's digest and where it sits."""
    h = hashlib.blake2b(digest_size=16, person=b"lmport-images")
    for image in images:
        h.update(f"{image.offset}:{image.num_tokens}:{image.digest};".encode())
    return h.hexdigest()


def check_placement(images: list[ImageInput], prompt_ids: list[int], image_token_id: int) -> None:
    """ValueError unless the images sit, in order and without overlapping, on runs of ``image_token_id`` in the
    prompt, each as long as the image's token count (an image with a ``span``: on that many tokens, the first a
    placeholder, one placeholder among them for each of its encoder rows), with no placeholder token left over."""
    end = 0
    for i, image in enumerate(images):
        if image.offset < end or image.end > len(prompt_ids):
            raise ValueError(f"image {i}: its tokens [{image.offset}, {image.end}) are out of order or past the "
                             f"prompt's {len(prompt_ids)} tokens")
        covered = prompt_ids[image.offset:image.end]
        if image.span is None and any(t != image_token_id for t in covered):
            raise ValueError(f"image {i}: the prompt's tokens [{image.offset}, {image.end}) are not all the image "
                             f"placeholder token {image_token_id}")
        if image.span is not None and (covered[:1] != [image_token_id]
                                       or sum(t == image_token_id for t in covered) != image.num_tokens):
            raise ValueError(f"image {i}: the prompt's tokens [{image.offset}, {image.end}) must start with the image "
                             f"placeholder token {image_token_id} and hold {image.num_tokens} of them, one for each "
                             f"of its encoder rows")
        if image.pixel_values is None:
            raise ValueError(f"image {i}: no pixel values")
        end = image.end
    if sum(t == image_token_id for t in prompt_ids) != sum(image.num_tokens for image in images):
        raise ValueError(f"the prompt has image placeholder tokens ({image_token_id}) that no image fills")
