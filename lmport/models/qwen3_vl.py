"""Qwen3-VL: Qwen3's paged decoder fed by a vision encoder whose deepstack features enter its first layers, with
interleaved multimodal rotary positions (M-RoPE).

What differs from Qwen2.5-VL (lmport.models.qwen2_vl):

- the decoder is Qwen3's: q and k normalized per head before rotary, no bias on q, k and v;
- the rotary module (transformers' own, adopted from the checkpoint) interleaves the three position axes over the
  frequencies (row and column on every third one, ``mrope_section`` of each), where Qwen2.5-VL gives each axis one
  contiguous section; the positions themselves follow the same rule (lmport.multimodal.mrope);
- deepstack: besides its merged output, the vision tower (transformers' own, adopted whole) gives one more set of
  rows for each of its ``deepstack_visual_indexes`` blocks, through a merger of its own; set ``i`` is added to the
  hidden states leaving decoder layer ``i`` at the image's token positions (transformers'
  ``Qwen3VLTextModel._deepstack_process``). A step that computes image tokens therefore runs the layers one by one;
  other steps take the backend's decoder runner where it has one.

The encoder runs as part of the prefill, once a step for every image whose tokens the step computes, all such images
of the batch in one call. Its rows (the merged output and each deepstack set side by side) are kept in the encoder
cache by image digest, so a chunked prefill that splits an image, or a preempted sequence, takes them from there or
encodes the image again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmport import ops
from lmport.kv.layout import LayerCache
from lmport.models import vision_language
from lmport.models.llama import PagedCausalLM
from lmport.multimodal.encoder_cache import EncoderCache
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.mrope import mrope_positions
from lmport.parallel import TPGroup
from lmport.platform.backend import Backend

QWEN3_VL_MODEL_TYPES = ("qwen3_vl",)   # its text view is Qwen2.5-VL's (lmport.models.qwen2_vl.text_view)


@dataclass(frozen=True)
class Deepstack:
    """What a step adds to the hidden states of the first decoder layers: ``features[i]`` [len(rows), hidden] is
    added after layer ``i`` at the step's token rows ``rows``."""
    rows: torch.Tensor
    features: torch.Tensor   # [levels, len(rows), hidden]


class Qwen3VLCausalLM(PagedCausalLM):
    """``step_images`` (set by the runner before each forward, lmport.worker.runner): each sequence's images, the
    new tokens and the cached tokens after the step, or None for a step without images."""

    model_types = ("qwen3",)   # the decoder built from the text view under Qwen3's type (q/k norm, no qkv bias)
    takes_images = True

    def __init__(self, cfg, backend: Backend, rotary, tp: TPGroup | None = None):
        decoder = vision_language.decoder_config(cfg, type(self).__name__, QWEN3_VL_MODEL_TYPES, "qwen3")
        super().__init__(decoder, backend, rotary, tp)
        self.merge_size = cfg.vision_config.spatial_merge_size
        self.visual: torch.nn.Module | None = None   # transformers' vision tower, taken from the checkpoint
        self.encoded = EncoderCache()
        self.step_images: tuple[list[list[ImageInput]], list[int], list[int]] | None = None

    def adopt(self, hf) -> None:
        """Take the loaded transformers model's rotary module and vision tower (with its deepstack mergers) as they
        are."""
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
        deepstack = None
        if step is not None:
            x, positions, deepstack = self.place_images(x, positions.clone(), *step)
        cos, sin = self.rotary(x, positions[:, None, :])
        rope = (cos[0], sin[0])
        metas = {w: meta.for_layer(w, self.attn_softcap) for w in set(self.windows)}
        # the backend's runner goes through every layer at once: no room to add the deepstack rows between them
        runner = self.decoder_runner() if deepstack is None else None
        out = None if runner is None else runner(x, [rope] * len(self.windows), caches,
                                                  [metas[w] for w in self.windows])
        if out is None:
            for i, (layer, cache, window) in enumerate(zip(self.model.layers, caches, self.windows, strict=True)):
                x = layer.forward(x, *rope, cache, metas[window])
                if deepstack is not None and i < len(deepstack.features):
                    x = x.index_add(0, deepstack.rows, deepstack.features[i].to(x.dtype))
            out = x
        return self.model.norm.forward(out)

    def place_images(self, x: torch.Tensor, positions: torch.Tensor, images: list[list[ImageInput]],
                     q_lens: list[int], kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, Deepstack | None]:
        """The step's embeddings with the encoder's rows at the image tokens it computes, its M-RoPE positions, and
        the deepstack rows of those tokens (None where the step computes no image token)."""
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
        if not places:
            return x, positions, None
        encoded = self.encode([image for image, *_ in places])
        hidden = x.shape[-1]
        x = x.clone()
        rows, features = [], []
        for image, at, first, count in places:
            part = encoded[image.digest][first:first + count]
            x[at:at + count] = part[:, :hidden].to(x.dtype)
            rows.append(torch.arange(at, at + count))
            features.append(part[:, hidden:])
        stacked = torch.cat(features).unflatten(-1, (-1, hidden)).transpose(0, 1)
        return x, positions, Deepstack(torch.cat(rows).to(x.device), stacked)

    def encode(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Each image's encoder rows by digest, [tokens, hidden x (1 + deepstack levels)]: the merged output, then
        each deepstack set, side by side; from the cache, the others encoded in one call."""
        out = {im.digest: rows for im in images if (rows := self.encoded.get(im.digest)) is not None}
        todo = list({im.digest: im for im in images if im.digest not in out}.values())
        if todo:
            if any(im.pixel_values is None for im in todo):
                raise ValueError("an image's tokens are computed without its pixel values")
            if self.visual is None:
                raise ValueError("the vision tower is not loaded")
            device, dtype = self.model.embed_tokens.weight.device, next(self.visual.parameters()).dtype
            pixels = torch.from_numpy(np.concatenate([im.pixel_values for im in todo])).to(device, dtype)
            grid = torch.tensor([im.grid_thw for im in todo], dtype=torch.long, device=device)
            encoded = self.visual(pixels, grid_thw=grid)
            rows = torch.cat([encoded.pooler_output, *encoded.deepstack_features], dim=-1)
            for im, part in zip(todo, rows.split([im.num_tokens for im in todo])):
                out[im.digest] = part
                self.encoded.put(im.digest, part)
        return out
