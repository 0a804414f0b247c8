"""Mistral 3 (Mistral Small 3.1 and 3.2, ``Mistral3ForConditionalGeneration``): a Mistral decoder fed by a Pixtral
vision tower through a projector with a patch merger.

The front end (lmport.multimodal.pixtral) lays each image out as rows of ``[IMG]`` tokens, each row ended by
``[IMG_BREAK]`` and the last by ``[IMG_END]``; the image is one ``ImageInput`` spanning them all. The vision tower
(patch convolution, 2D rotary positions by patch row and column, attention within each image) and the projector (a
norm, the learned merge of each ``spatial_merge_size`` x ``spatial_merge_size`` patches, two linear layers) are
transformers' own modules, taken from the loaded checkpoint: they run on the engine's device as part of the prefill,
once a step for every image whose tokens the step computes, the batch's images together (up to ``ENCODE_PATCHES``
patches a call) as transformers batches them (padded to the largest, each image's patches cropped back to its own
size). Their rows
replace the embeddings of the image's ``[IMG]`` tokens only, row by row; the breaks and the end keep their own
embeddings. Positions are the ordinary 1-D ones, so the decoder is Mistral's (or Llama's) as lmport runs it.

An image whose tokens a chunked prefill splits across steps takes its rows from the encoder cache (by image digest,
lmport.multimodal.encoder_cache) or is encoded whole again; a preempted sequence recomputes its K/V and, where the
cache lost them, its images' encodings.
"""
from __future__ import annotations

import numpy as np
import torch

from lmport.models import vision_language
from lmport.models.llama import PagedCausalLM
from lmport.multimodal.encoder_cache import EncoderCache
from lmport.multimodal.inputs import ImageInput
from lmport.platform.backend import Backend
from lmport.parallel import TPGroup

MISTRAL3_MODEL_TYPES = ("mistral3",)
# the text models of Mistral 3 checkpoints lmport's decoder runs (Ministral 3's "ministral3" scales its attention
# by position, which it does not)
MISTRAL3_TEXT_TYPES = ("mistral", "llama")
# Patches one vision tower call takes (an image larger than this goes alone): transformers' Pixtral attends with a mask
# over all of a call's patches, its size the square of their count, so images are encoded together only up to this.
ENCODE_PATCHES = 4096


def mistral3_text_view(cfg):
    """lmport's config of a Mistral 3 checkpoint: its Mistral text config with the vision config, the projector's
    settings and the image token; ValueError for a text model lmport's decoder does not run."""
    text_type = cfg.text_config.model_type
    if text_type not in MISTRAL3_TEXT_TYPES:
        raise ValueError(f"a Mistral 3 checkpoint with a {text_type!r} text model is not supported; lmport runs "
                         f"Mistral 3 with a {' or '.join(repr(t) for t in MISTRAL3_TEXT_TYPES)} text model "
                         f"(Mistral Small 3.1, 3.2)")
    return vision_language.text_view(cfg, image_token_id=cfg.image_token_id, spatial_merge_size=cfg.spatial_merge_size,
                                     vision_feature_layer=cfg.vision_feature_layer, text_model_type=text_type)


class Mistral3CausalLM(PagedCausalLM):
    """``step_images`` (set by the runner before each forward, lmport.worker.runner): each sequence's images, the new
    tokens and the cached tokens after the step, or None for a step without images."""

    model_types = MISTRAL3_TEXT_TYPES   # the decoder built from the text view under its text model's type
    takes_images = True

    def __init__(self, cfg, backend: Backend, rotary, tp: TPGroup | None = None):
        decoder = vision_language.decoder_config(cfg, type(self).__name__, MISTRAL3_MODEL_TYPES, cfg.text_model_type)
        super().__init__(decoder, backend, rotary, tp)
        self.patch_size = cfg.vision_config.patch_size
        self.merge_size = cfg.spatial_merge_size
        self.feature_layer: int | list[int] = cfg.vision_feature_layer
        self.vision_tower: torch.nn.Module | None = None   # transformers' Pixtral tower, taken from the checkpoint
        self.projector: torch.nn.Module | None = None      # its norm, patch merger and projection to the text's width
        self.encoded = EncoderCache()
        self.encode_patches = ENCODE_PATCHES
        self.step_images: tuple[list[list[ImageInput]], list[int], list[int]] | None = None

    def adopt(self, hf) -> None:
        """Take the loaded transformers model's rotary module, vision tower and projector as they are."""
        self.rotary = hf.model.language_model.rotary_emb
        self.vision_tower = hf.model.vision_tower
        self.projector = hf.model.multi_modal_projector

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The language model's tensors under the decoder's names; the vision tower's and projector's are adopted."""
        return super().shard_state_dict(vision_language.text_tensors(
            full, "model.language_model.", ("model.vision_tower.", "model.multi_modal_projector.")))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        step, self.step_images = self.step_images, None
        x = super().embed(input_ids)
        return x if step is None else self.place_images(x, *step)

    @staticmethod
    def layout(image: ImageInput) -> tuple[int, int]:
        """An image's rows of ``[IMG]`` tokens and the tokens in each: its span holds one break (or the end) a row."""
        rows = (image.span or image.num_tokens) - image.num_tokens
        if rows <= 0 or image.num_tokens % rows:
            raise ValueError(f"an image of {image.num_tokens} [IMG] tokens over {image.span} is not laid out in rows "
                             f"ended by [IMG_BREAK] and [IMG_END] (lmport.multimodal.pixtral lays them out)")
        return rows, image.num_tokens // rows

    def place_images(self, x: torch.Tensor, images: list[list[ImageInput]], q_lens: list[int],
                     kv_lens: list[int]) -> torch.Tensor:
        """The step's embeddings with the encoder's rows at the ``[IMG]`` tokens it computes."""
        places = vision_language.step_places(images, q_lens, kv_lens)
        if not places:
            return x
        encoded = self.encode([p.image for p in places])
        x = x.clone()
        for image, at, first, count in places:
            cols = self.layout(image)[1]
            # the span's tokens from first: each row of cols [IMG] is followed by a break (the last by the end)
            within = torch.arange(first, first + count, device=x.device)
            line, col = within // (cols + 1), within % (cols + 1)
            taken = col < cols
            x[at + (within - first)[taken]] = encoded[image.digest][(line * cols + col)[taken]].to(x.dtype)
        return x

    def encode(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Each image's projector output rows by digest: from the cache, the others encoded together, in as few
        calls as ``encode_patches`` allows."""
        return self.encoded.rows_of(images, self.run_tower)

    def run_tower(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The images' projector output rows, in order, from as few calls as ``encode_patches`` allows."""
        cell = self.patch_size * self.merge_size
        groups: list[tuple[list[ImageInput], int]] = []
        for im in images:
            height, width = im.pixel_values.shape[1:]   # pyright: ignore[reportOptionalMemberAccess]
            if (height // cell, width // cell) != self.layout(im):
                raise ValueError(f"a {height} x {width} image gives {height // cell} x {width // cell} encoder rows "
                                 f"for its {' x '.join(map(str, self.layout(im)))} [IMG] tokens; the processor's "
                                 f"patch_size and spatial_merge_size do not match the model's ({self.patch_size} and "
                                 f"{self.merge_size})")
            patches = (height // self.patch_size) * (width // self.patch_size)
            if groups and groups[-1][1] + patches <= self.encode_patches:
                groups[-1] = (groups[-1][0] + [im], groups[-1][1] + patches)
            else:
                groups.append(([im], patches))
        return [rows for group, _ in groups for rows in self.encode_together(group)]

    def encode_together(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The images' projector output rows, from one call of the vision tower (as transformers encodes a prompt's
        images: padded to the largest, each cropped back to its own patches, attending within itself)."""
        if self.vision_tower is None or self.projector is None:
            raise ValueError("the vision tower is not loaded")
        device, dtype = self.model.embed_tokens.weight.device, next(self.vision_tower.parameters()).dtype
        sizes = [im.pixel_values.shape[1:] for im in images]   # pyright: ignore[reportOptionalMemberAccess]
        batch = np.zeros((len(images), 3, max(h for h, _ in sizes), max(w for _, w in sizes)), dtype=np.float32)
        for i, im in enumerate(images):
            batch[i, :, :sizes[i][0], :sizes[i][1]] = im.pixel_values
        pixels = torch.from_numpy(batch).to(device, dtype)
        image_sizes = torch.tensor([list(s) for s in sizes], dtype=torch.long, device=device)
        hidden = self.vision_tower(pixels, image_sizes=image_sizes, output_hidden_states=True).hidden_states
        if isinstance(self.feature_layer, int):
            features = hidden[self.feature_layer]
        else:
            features = torch.cat([hidden[layer] for layer in self.feature_layer], dim=-1)
        rows = self.projector(features.squeeze(0), image_sizes)
        return list(rows.split([im.num_tokens for im in images]))
