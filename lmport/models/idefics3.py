"""Idefics3 (SmolVLM): Llama's paged decoder fed by a SigLIP vision tower through a pixel-shuffle connector.

The front end (lmport.multimodal.tiles) cuts each image into tiles plus a global image with transformers' own
processor; each tile is one ``ImageInput`` on its run of ``<image>`` tokens. The vision tower and the connector are
transformers' own modules, taken from the loaded checkpoint: they run on the engine's device as part of the
prefill, once a step for every tile whose tokens the step computes, all such tiles of the batch in one call, and
their output rows replace the embeddings of the tile's tokens. Positions are the ordinary 1-D ones (no multimodal
rotary), so the decoder is Llama's as lmport runs it.

A tile whose tokens a chunked prefill splits across steps takes its rows from the encoder cache (by tile digest,
lmport.multimodal.encoder_cache) or is encoded again; a preempted sequence recomputes its K/V and, where the
cache lost them, its tiles' encodings.
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

IDEFICS3_MODEL_TYPES = ("idefics3",)


def idefics3_text_view(cfg):
    """lmport's config of an Idefics3 checkpoint: its Llama text config with the vision config, the connector's
    scale factor and the image token."""
    return vision_language.text_view(cfg, scale_factor=cfg.scale_factor, image_token_id=cfg.image_token_id)


class Idefics3CausalLM(PagedCausalLM):
    """``step_images`` (set by the runner before each forward, lmport.worker.runner): each sequence's tiles, the new
    tokens and the cached tokens after the step, or None for a step without images."""

    model_types = ("llama",)   # the decoder built from the text view under Llama's type
    takes_images = True

    def __init__(self, cfg, backend: Backend, rotary, tp: TPGroup | None = None):
        decoder = vision_language.decoder_config(cfg, type(self).__name__, IDEFICS3_MODEL_TYPES, "llama")
        super().__init__(decoder, backend, rotary, tp)
        self.patch_size = cfg.vision_config.patch_size
        self.vision_model: torch.nn.Module | None = None   # transformers' SigLIP tower, taken from the checkpoint
        self.connector: torch.nn.Module | None = None      # its pixel shuffle and projection to the text's width
        self.encoded = EncoderCache()
        self.step_images: tuple[list[list[ImageInput]], list[int], list[int]] | None = None

    def adopt(self, hf) -> None:
        """Take the loaded transformers model's rotary module, vision tower and connector as they are."""
        self.rotary = hf.model.text_model.rotary_emb
        self.vision_model = hf.model.vision_model
        self.connector = hf.model.connector

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The text model's tensors under the decoder's names; the vision tower's and connector's are adopted."""
        return super().shard_state_dict(vision_language.text_tensors(full, "model.text_model.",
                                                                     ("model.vision_model.", "model.connector.")))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        step, self.step_images = self.step_images, None
        x = super().embed(input_ids)
        return x if step is None else self.place_tiles(x, *step)

    def place_tiles(self, x: torch.Tensor, images: list[list[ImageInput]], q_lens: list[int],
                    kv_lens: list[int]) -> torch.Tensor:
        """The step's embeddings with the encoder's rows at the tile tokens it computes."""
        places = vision_language.step_places(images, q_lens, kv_lens)
        if not places:
            return x
        return vision_language.with_rows(x, places, self.encode([p.image for p in places]))

    def encode(self, tiles: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Each tile's connector output rows by digest: from the cache, the others encoded in one call for each tile
        size (a checkpoint's tiles are all one size)."""
        return self.encoded.rows_of(tiles, self.run_tower)

    def run_tower(self, tiles: list[ImageInput]) -> list[torch.Tensor]:
        """The tiles' connector output rows, in order."""
        if self.vision_model is None or self.connector is None:
            raise ValueError("the vision tower is not loaded")
        weight = next(self.vision_model.parameters())   # on the engine's device (a GGUF's embedding may be quantized)
        device, dtype = weight.device, weight.dtype
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, t in enumerate(tiles):
            by_size.setdefault(t.pixel_values.shape, []).append(i)   # pyright: ignore[reportOptionalMemberAccess]
        out: list[torch.Tensor] = [torch.empty(0)] * len(tiles)
        for (_, height, width), group in by_size.items():
            pixels = torch.from_numpy(np.stack([tiles[i].pixel_values for i in group])).to(device, dtype)
            # whole tiles: every patch is the image's (transformers' mask of an unpadded tile)
            mask = torch.ones(len(group), height // self.patch_size, width // self.patch_size, dtype=torch.bool,
                              device=device)
            hidden = self.vision_model(pixel_values=pixels, patch_attention_mask=mask).last_hidden_state
            for i, part in zip(group, self.connector(hidden)):
                if len(part) != tiles[i].num_tokens:
                    raise ValueError(f"a tile gives {len(part)} encoder rows for its {tiles[i].num_tokens} tokens; "
                                     f"the processor's image_seq_len does not match the model's")
                out[i] = part
        return out
