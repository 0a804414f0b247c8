"""Model dimensions read from a transformers config alone, for code that sizes memory without building a model."""
from __future__ import annotations


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
