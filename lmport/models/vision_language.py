"""What lmport's vision-language models share: the checkpoint's text config read as the decoder's, the decoder
built under its text model's type, and the text model's tensors under the decoder's names (the vision modules
are transformers' own, adopted whole)."""
from __future__ import annotations

import copy

import torch


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
