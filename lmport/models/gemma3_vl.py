"""Gemma 3 with images (``Gemma3ForConditionalGeneration``: Gemma 3 4B, 12B, 27B): Gemma 3's paged text decoder
fed by a SigLIP vision tower through ``Gemma3MultiModalProjector``, an image's tokens attending to each other both
ways.

The front end (lmport.multimodal.gemma3) replaces the template's ``<start_of_image>`` with what transformers'
``Gemma3Processor`` writes: ``\\n\\n<start_of_image>``, ``mm_tokens_per_image`` image soft tokens,
``<end_of_image>\\n\\n``; the soft tokens are one ``ImageInput``. The vision tower and the projector (average pool to
``mm_tokens_per_image`` rows, the soft-embedding norm, the projection to the text's width) are transformers' own
modules, taken from the loaded checkpoint: they run on the engine's device as part of the prefill, the step's images
in one call, and their rows replace the soft tokens' embeddings. The text tokens' embeddings are scaled by
sqrt(hidden_size) (lmport.models.gemma), the image rows are not, as transformers merges them.

Attention: an image's soft tokens see each other both ways, the rest stays causal (transformers'
``create_masks_for_vision_model``: or-ed with the causal mask on every layer, and-ed with the window on the
sliding ones); the step's images become ``AttentionMetadata.bidirectional`` spans, run by the backend's
``paged_attention`` (the "bidirectional" attention variant: a backend without it refuses the model when it loads).
A step that computes image tokens runs the layers one by one; other steps take the backend's decoder runner. Since
a token cannot see keys computed in a later step, no prefill chunk ends inside an image: the scheduler keeps each
image's tokens in one chunk (lmport.multimodal.chunks; a prefix-cache hit may end inside one, its K/V computed
with the whole image).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lmport import ops
from lmport.kv.layout import LayerCache
from lmport.models import vision_language
from lmport.models.gemma import GemmaCausalLM
from lmport.multimodal.encoder_cache import EncoderCache
from lmport.multimodal.inputs import ImageInput
from lmport.parallel import TPGroup
from lmport.platform.backend import Backend

GEMMA3_VL_MODEL_TYPES = ("gemma3",)
BIDIRECTIONAL = "bidirectional"   # the attention variant (lmport.platform.backend.ATTENTION_VARIANTS)


def gemma3_text_view(cfg):
    """lmport's config of a Gemma 3 image-text checkpoint: its Gemma 3 text config with the vision config, the
    image tokens and the tokens an image gives."""
    return vision_language.text_view(cfg, image_token_id=cfg.image_token_id, boi_token_id=cfg.boi_token_id,
                                     eoi_token_id=cfg.eoi_token_id, mm_tokens_per_image=cfg.mm_tokens_per_image)


class Gemma3VLCausalLM(GemmaCausalLM):
    """``step_images`` (set by the runner before each forward, lmport.worker.runner): each sequence's images, the new
    tokens and the cached tokens after the step, or None for a step without images."""

    model_types = ("gemma3_text",)   # the decoder built from the text view under Gemma 3's text type
    takes_images = True

    def __init__(self, cfg, backend: Backend, rotary, tp: TPGroup | None = None):
        decoder = vision_language.decoder_config(cfg, type(self).__name__, GEMMA3_VL_MODEL_TYPES, "gemma3_text")
        super().__init__(decoder, backend, rotary, tp)
        self.image_tokens = cfg.mm_tokens_per_image
        self.vision_tower: torch.nn.Module | None = None   # transformers' SigLIP tower, taken from the checkpoint
        self.projector: torch.nn.Module | None = None      # Gemma3MultiModalProjector: pool, norm, projection
        self.encoded = EncoderCache()
        self.step_images: tuple[list[list[ImageInput]], list[int], list[int]] | None = None

    @classmethod
    def attention_variants(cls, cfg) -> set[str]:
        return super().attention_variants(cfg) | {BIDIRECTIONAL}

    def adopt(self, hf) -> None:
        """Take the loaded transformers model's rotary module, vision tower and projector as they are."""
        self.rotary = hf.model.language_model.rotary_emb
        self.vision_tower = hf.model.vision_tower
        self.projector = hf.model.multi_modal_projector

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The language model's tensors under the decoder's names; the vision tower's and projector's are adopted."""
        return super().shard_state_dict(vision_language.text_tensors(
            full, "model.language_model.", ("model.vision_tower.", "model.multi_modal_projector.")))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: ops.AttentionMetadata, caches: list[LayerCache]) -> torch.Tensor:
        step, self.step_images = self.step_images, None
        spans = None
        if step is None:
            x = self.embed(input_ids)
        else:
            x, spans = self.place_images(self.embed(input_ids), *step)
        if spans is None:   # no image token in the step: causal throughout, the backend's runner where it has one
            return self.run_layers(x, meta, caches, self.decoder_runner())
        return self.run_layers(x, dataclasses.replace(meta, bidirectional=spans), caches, None)

    def run_layers(self, x: torch.Tensor, meta: ops.AttentionMetadata, caches: list[LayerCache],
                   runner: ops.DecoderRunner | None) -> torch.Tensor:
        """The decoder over the step's embeddings ``x``: through ``runner`` where it is given and takes the step,
        else layer by layer (PagedCausalLM.forward's loop)."""
        ropes = {kind: self.rope_rows(kind, x, meta) for kind in self.rope_tables}
        metas = {w: meta.for_layer(w, self.attn_softcap) for w in set(self.windows)}
        out = None if runner is None else runner(x, [ropes[kind] for kind in self.rope_kinds], caches,
                                                  [metas[w] for w in self.windows])
        if out is None:
            for layer, cache, window, kind in zip(self.model.layers, caches, self.windows, self.rope_kinds,
                                                  strict=True):
                x = layer.forward(x, *ropes[kind], cache, metas[window])
            out = x
        return self.model.norm.forward(out)

    def place_images(self, x: torch.Tensor, images: list[list[ImageInput]], q_lens: list[int],
                     kv_lens: list[int]) -> tuple[torch.Tensor, tuple[tuple[tuple[int, int], ...], ...] | None]:
        """The step's embeddings with the encoder's rows at the image tokens it computes, and each sequence's spans
        of those images (None where the step computes no image token). ValueError for a step that ends inside an
        image: its tokens could not see the image's later ones."""
        row, places, spans = 0, [], []
        for seq_images, q, kv in zip(images, q_lens, kv_lens):
            start, own = kv - q, []
            for image in seq_images:
                lo, hi = max(start, image.offset), min(kv, image.end)
                if lo >= hi:
                    continue
                if hi < image.end:
                    raise ValueError(f"a prefill step ends at token {kv}, inside an image's tokens [{image.offset}, "
                                     f"{image.end}), which attend to each other both ways and must be computed in "
                                     f"one step; raise max_prefill_token_num to {image.end - image.offset} or more")
                places.append((image, row + lo - start, lo - image.offset, hi - lo))
                own.append((image.offset, image.end))
            spans.append(tuple(own))
            row += q
        if not places:
            return x, None
        encoded = self.encode([image for image, *_ in places])
        x = x.clone()
        for image, at, first, count in places:
            x[at:at + count] = encoded[image.digest][first:first + count].to(x.dtype)
        return x, tuple(spans)

    def encode(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Each image's projector output rows by digest: from the cache, the others encoded in one call (the
        processor gives every image the one size the tower takes)."""
        return self.encoded.rows_of(images, self.run_tower)

    def run_tower(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The images' projector output rows, from one call of the vision tower."""
        if self.vision_tower is None or self.projector is None:
            raise ValueError("the vision tower is not loaded")
        weight = next(self.vision_tower.parameters())   # on the engine's device
        pixels = torch.from_numpy(np.stack([im.pixel_values for im in images])).to(weight.device, weight.dtype)
        rows = list(self.projector(self.vision_tower(pixel_values=pixels).last_hidden_state))
        for im, part in zip(images, rows):
            if len(part) != im.num_tokens:
                raise ValueError(f"an image gives {len(part)} encoder rows for its {im.num_tokens} tokens; the "
                                 f"processor's image_seq_length does not match the model's mm_tokens_per_image "
                                 f"({self.image_tokens})")
        return rows
