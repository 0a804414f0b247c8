"""Llama 4 with images (``Llama4ForConditionalGeneration``: Llama 4 Scout and Maverick): lmport's Llama 4 text decoder
(chunked local attention, NoPE layers, mixture-of-experts MLPs: lmport.models.llama4) fed by transformers' Llama 4
vision model through its multi-modal projector.

The front end (lmport.multimodal.llama4) cuts each image into tiles plus, for more than one, a global view, and lays
out each tile's run of ``<|patch|>`` tokens among the image's start, separators, ``<|image|>`` and end tokens; each
tile is one ``ImageInput``. The vision model (patch unfold, a class token, 2D rotary, attention within each tile, the
pixel-shuffle adapter) and the projector are transformers' own modules, taken from the loaded checkpoint (or built
from a GGUF text model's mmproj file, lmport.multimodal.mmproj): they run on
the engine's device as part of the prefill, all the tiles a step computes tokens of in one call, and their rows
replace the embeddings of the tiles' ``<|patch|>`` tokens; every other token of the image keeps its own embedding.
Attention stays causal over image tokens (chunked on the rope layers) with the ordinary 1-D positions, as transformers
computes it, so the decoder is Llama 4's as lmport runs it.

A tile whose tokens a chunked prefill splits across steps takes its rows from the encoder cache (by tile digest,
lmport.multimodal.encoder_cache) or is encoded again; a preempted sequence recomputes its K/V and, where the cache
lost them, its tiles' encodings.
"""
from __future__ import annotations

import numpy as np
import torch

from lmport.models import vision_language
from lmport.models.llama4 import Llama4CausalLM
from lmport.multimodal.encoder_cache import EncoderCache
from lmport.multimodal.inputs import ImageInput
from lmport.parallel import TPGroup
from lmport.platform.backend import Backend

LLAMA4_VL_MODEL_TYPES = ("llama4",)


def llama4_text_view(cfg):
    """lmport's config of a Llama 4 image-text checkpoint: its Llama 4 text config with the vision config and the
    image token (``<|patch|>``, whose embeddings the vision rows replace)."""
    return vision_language.text_view(cfg, image_token_id=cfg.image_token_id)


class Llama4VLCausalLM(Llama4CausalLM):
    """``step_images`` (set by the runner before each forward, lmport.worker.runner): each sequence's tiles, the new
    tokens and the cached tokens after the step, or None for a step without images."""

    model_types = ("llama4_text",)   # the decoder built from the text view under Llama 4's text type
    takes_images = True

    def __init__(self, cfg, backend: Backend, rotary, tp: TPGroup | None = None):
        decoder = vision_language.decoder_config(cfg, type(self).__name__, LLAMA4_VL_MODEL_TYPES, "llama4_text")
        super().__init__(decoder, backend, rotary, tp)
        self.vision_model: torch.nn.Module | None = None   # transformers' Llama4VisionModel, from the checkpoint
        self.projector: torch.nn.Module | None = None      # Llama4MultiModalProjector: to the text's width
        self.encoded = EncoderCache()
        self.step_images: tuple[list[list[ImageInput]], list[int], list[int]] | None = None

    def adopt(self, hf) -> None:
        """Take the loaded transformers model's rotary module, vision model and projector as they are."""
        self.rotary = hf.language_model.model.rotary_emb
        self.vision_model = hf.vision_model
        self.projector = hf.multi_modal_projector

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The language model's tensors under the decoder's names; the vision model's and projector's are adopted."""
        text = {("lm_head." + k[len("language_model.lm_head."):] if k.startswith("language_model.lm_head.") else k): v
                for k, v in full.items()}
        return super().shard_state_dict(vision_language.text_tensors(
            text, "language_model.model.", ("vision_model.", "multi_modal_projector.")))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        step, self.step_images = self.step_images, None
        x = super().embed(input_ids)
        return x if step is None else self.place_tiles(x, *step)

    def place_tiles(self, x: torch.Tensor, images: list[list[ImageInput]], q_lens: list[int],
                    kv_lens: list[int]) -> torch.Tensor:
        """The step's embeddings with the vision rows at the tile tokens it computes."""
        places = vision_language.step_places(images, q_lens, kv_lens)
        if not places:
            return x
        return vision_language.with_rows(x, places, self.encoded.rows_of([p.image for p in places], self.run_tower))

    def run_tower(self, tiles: list[ImageInput]) -> list[torch.Tensor]:
        """The tiles' projected vision rows, in order, from one call of the vision model (a checkpoint's tiles are all
        one size: the vision model's ``image_size``)."""
        if self.vision_model is None or self.projector is None:
            raise ValueError("the vision model is not loaded")
        weight = self.projector.linear_1.weight
        pixels = torch.from_numpy(np.stack([t.pixel_values for t in tiles])).to(weight.device, weight.dtype)  # pyright: ignore[reportArgumentType]
        size = self.vision_model.image_size
        if tuple(pixels.shape[-2:]) != (size, size):
            raise ValueError(f"a tile of {pixels.shape[-2]} x {pixels.shape[-1]} pixels for a vision model of "
                             f"{size} x {size}; the processor's size must be the model's image_size")
        hidden = self.vision_model(pixels).last_hidden_state
        rows = self.projector(hidden)
        if rows.shape[1] != tiles[0].num_tokens:
            raise ValueError(f"a tile gives {rows.shape[1]} vision rows for its {tiles[0].num_tokens} tokens; the "
                             f"processor's patch_size and pixel_shuffle_ratio do not match the model's")
        return list(rows.unbind(0))
