"""Qwen2.5-VL: Qwen2's paged decoder fed by a vision encoder, with multimodal rotary positions (M-RoPE).

The vision tower (patch embedding, windowed vision blocks, the 2 x 2 patch merger) is transformers' own module,
taken from the loaded checkpoint as the rotary module is: it runs on the engine's device as part of the prefill,
once a step for every image whose placeholder tokens the step computes, all such images of the batch in one call.
Its output rows replace the embeddings of the image's placeholder tokens. The decoder is Qwen2's (bias on q, k
and v), with each token's cos/sin taken at its three positions (lmport.multimodal.mrope) through transformers'
M-RoPE rotary module.

An image whose tokens a chunked prefill splits across steps is encoded whole at each step that computes some of its
tokens, unless its output is still in the encoder cache (lmport.multimodal.encoder_cache: by image digest, least
recently used dropped first); so a split image always resumes, and a preempted sequence recomputes its KV and, where
the cache lost them, its images' encodings.
"""
from __future__ import annotations


import numpy as np
import torch

from lmport import ops
from lmport.kv.layout import LayerCache
from lmport.models import vision_language
from lmport.models.llama import PagedCausalLM
from lmport.multimodal.encoder_cache import EncoderCache
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.mrope import mrope_positions
from lmport.platform.backend import Backend
from lmport.parallel import TPGroup

QWEN2_VL_MODEL_TYPES = ("qwen2_5_vl",)


def text_view(cfg):
    """lmport's config of a Qwen2.5-VL checkpoint: its text config with the vision config and image tokens."""
    return vision_language.text_view(cfg, **{name: getattr(cfg, name, None) for name in (
        "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")})


class Qwen2VLCausalLM(PagedCausalLM):
    """``step_images`` (set by the runner before each forward, lmport.worker.runner): each sequence's images, the
    new tokens and the cached tokens after the step, or None for a step without images."""

    model_types = ("qwen2",)   # the decoder built from the text view under Qwen2's type (bias on q, k and v)
    vision_model_types = QWEN2_VL_MODEL_TYPES
    takes_images = True

    def __init__(self, cfg, backend: Backend, rotary, tp: TPGroup | None = None):
        decoder = vision_language.decoder_config(cfg, type(self).__name__, self.vision_model_types,
                                                 self.model_types[0])
        super().__init__(decoder, backend, rotary, tp)
        self.merge_size = cfg.vision_config.spatial_merge_size
        self.visual: torch.nn.Module | None = None   # transformers' vision tower, taken from the checkpoint
        self.encoded = EncoderCache()
        self.step_images: tuple[list[list[ImageInput]], list[int], list[int]] | None = None

    def adopt(self, hf) -> None:
        """Take the loaded transformers model's rotary module and vision tower as they are."""
        self.rotary = hf.model.language_model.rotary_emb
        self.visual = hf.model.visual

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The language model's tensors under the decoder's names; the vision tower's are adopted whole."""
        return super().shard_state_dict(vision_language.text_tensors(full, "model.language_model.", ("model.visual.",)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: ops.AttentionMetadata, caches: list[LayerCache]) -> torch.Tensor:
        step, self.step_images = self.step_images, None
        x = self.model.embed_tokens(input_ids)
        positions = meta.positions.expand(3, -1)
        placed: list[tuple[int, torch.Tensor]] = []
        if step is not None:
            x, positions, placed = self.place_images(x, positions.clone(), *step)
        cos, sin = self.rotary(x, positions[:, None, :])
        return self.model.norm.forward(self.decode(x, (cos[0], sin[0]), meta, caches, placed))

    def decode(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: ops.AttentionMetadata,
               caches: list[LayerCache], placed: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """The decoder's layers over the step's embeddings (``placed``: the encoder rows ``place_images`` put in)."""
        metas = {w: meta.for_layer(w, self.attn_softcap) for w in set(self.windows)}
        runner = self.decoder_runner()
        out = None if runner is None else runner(x, [rope] * len(self.windows), caches,
                                                  [metas[w] for w in self.windows])
        if out is None:
            for layer, cache, window in zip(self.model.layers, caches, self.windows, strict=True):
                x = layer.forward(x, *rope, cache, metas[window])
            out = x
        return out

    def place_images(self, x: torch.Tensor, positions: torch.Tensor, images: list[list[ImageInput]],
                     q_lens: list[int], kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                     list[tuple[int, torch.Tensor]]]:
        """The step's embeddings with the encoder's rows at the image tokens it computes (their first ``hidden``
        columns), its M-RoPE positions, and those rows by the step row they start at."""
        row, places = 0, []
        for seq_images, q, kv in zip(images, q_lens, kv_lens):
            start = kv - q
            if seq_images:
                positions[:, row:row + q] = mrope_positions(seq_images, start, kv, self.merge_size).to(positions)
                for image in seq_images:
                    lo, hi = max(start, image.offset), min(kv, image.end)
                    if lo < hi:
                        places.append((image, row + lo - start, lo - image.offset, hi - lo))
            row += q
        placed = []
        if places:
            encoded = self.encode([image for image, *_ in places])
            x = x.clone()
            for image, at, first, count in places:
                rows = encoded[image.digest][first:first + count]
                x[at:at + count] = rows[:, :x.shape[-1]].to(x.dtype)
                placed.append((at, rows))
        return x, positions, placed

    def encode(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Each image's encoder output rows by digest: from the cache, the others encoded in one call."""
        return self.encoded.rows_of(images, self.run_tower)

    def run_tower(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The images' encoder output rows, from one call of the vision tower."""
        if (visual := self.visual) is None:
            raise ValueError("the vision tower is not loaded")
        weight = next(visual.parameters())   # on the engine's device (a GGUF's embedding may be quantized)
        pixels = torch.from_numpy(np.concatenate([im.pixel_values for im in images])).to(weight.device, weight.dtype)
        grid = torch.tensor([im.grid_thw for im in images], dtype=torch.long, device=weight.device)
        return list(self.tower_rows(visual, pixels, grid).split([im.num_tokens for im in images]))

    def tower_rows(self, visual: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The vision tower's output rows for a call's patches."""
        return visual(pixels, grid_thw=grid).pooler_output
