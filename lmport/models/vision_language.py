"""What lmport's vision-language models share: the checkpoint's text config read as the decoder's, the decoder
built under its text model's type, the text model's tensors under the decoder's names (the vision modules
are transformers' own, adopted whole), and where a step's image tokens are."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from lmport.multimodal.inputs import ImageInput


def text_view(cfg, **fields):
    """The checkpoint's text config (what the KV layout, the memory plan and the decoder read) under the
    checkpoint's model type, with the vision config and ``fields`` (its image tokens, ...) beside it."""
    text = copy.deepcopy(cfg.text_config)
    text.model_type = cfg.model_type
    text.vision_config = cfg.vision_config
    for name, value in fields.items():
        setattr(text, name, value)
    text.tie_word_embeddings = getattr(cfg, "tie_word_embeddings", False)
    text.architectures = getattr(cfg, "architectures", None)
    return text


def decoder_config(cfg, owner: str, model_types: tuple[str, ...], decoder_type: str):
    """``cfg`` (a text view) under ``decoder_type``, the model type whose decoder ``owner`` builds; ValueError for a
    checkpoint type it does not run."""
    if cfg.model_type not in model_types:
        raise ValueError(f"model type {cfg.model_type!r} is not one {owner} runs; it runs {', '.join(model_types)}")
    decoder = copy.copy(cfg)
    decoder.model_type = decoder_type
    return decoder


def text_tensors(full: dict[str, torch.Tensor], text_prefix: str,
                 vision_prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The text model's tensors (``text_prefix``) under the decoder's names ("model."), the vision modules' left out."""
    return {("model." + k[len(text_prefix):] if k.startswith(text_prefix) else k): v for k, v in full.items()
            if not k.startswith(vision_prefixes)}


class Place(NamedTuple):
    """A run of one image's tokens that a step computes."""
    image: ImageInput
    row: int     # the step's row of the run's first token
    first: int   # that token's index among the image's
    count: int


def step_places(images: list[list[ImageInput]], q_lens: list[int], kv_lens: list[int]) -> list[Place]:
    """The runs of image tokens a step computes, in row order: each sequence's images, its ``q`` new tokens ending
    at ``kv``."""
    row, places = 0, []
    for seq_images, q, kv in zip(images, q_lens, kv_lens):
        start = kv - q
        for image in seq_images:
            lo, hi = max(start, image.offset), min(kv, image.end)
            if lo < hi:
                places.append(Place(image, row + lo - start, lo - image.offset, hi - lo))
        row += q
    return places


def with_rows(x: torch.Tensor, places: list[Place], encoded: dict[str, torch.Tensor]) -> torch.Tensor:
    """A copy of the step's embeddings ``x`` with each place's encoder rows (``encoded`` by image digest) at its
    tokens."""
    x = x.clone()
    for image, at, first, count in places:
        x[at:at + count] = encoded[image.digest][first:first + count].to(x.dtype)
    return x
