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

import torch

from lmport import ops
from lmport.kv.layout import LayerCache
from lmport.models.qwen2_vl import Qwen2VLCausalLM

QWEN3_VL_MODEL_TYPES = ("qwen3_vl",)   # its text view is Qwen2.5-VL's (lmport.models.qwen2_vl.text_view)


class Qwen3VLCausalLM(Qwen2VLCausalLM):
    """Qwen2.5-VL's model (lmport.models.qwen2_vl) with Qwen3's decoder and the deepstack rows added between its
    first layers."""

    model_types = ("qwen3",)   # the decoder built from the text view under Qwen3's type (q/k norm, no qkv bias)
    vision_model_types = QWEN3_VL_MODEL_TYPES

    def tower_rows(self, visual: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden x (1 + deepstack levels)]: the merged output, then each deepstack set, side by side."""
        encoded = visual(pixels, grid_thw=grid)
        return torch.cat([encoded.pooler_output, *encoded.deepstack_features], dim=-1)

    def decode(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: ops.AttentionMetadata,
               caches: list[LayerCache], placed: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """The layers one by one where the step computes image tokens (the backend's runner goes through every
        layer at once: no room to add the deepstack rows between them), deepstack set ``i`` added after layer
        ``i`` at those tokens' rows."""
        if not placed:
            return super().decode(x, rope, meta, caches, placed)
        hidden = x.shape[-1]
        rows = torch.cat([torch.arange(at, at + len(part)) for at, part in placed]).to(x.device)
        deepstack = torch.cat([part[:, hidden:] for _, part in placed]).unflatten(-1, (-1, hidden)).transpose(0, 1)
        metas = {w: meta.for_layer(w, self.attn_softcap) for w in set(self.windows)}
        for i, (layer, cache, window) in enumerate(zip(self.model.layers, caches, self.windows, strict=True)):
            x = layer.forward(x, *rope, cache, metas[window])
            if i < len(deepstack):
                x = x.index_add(0, rows, deepstack[i].to(x.dtype))
        return x
