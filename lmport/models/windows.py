"""Which layers of a model attend through a sliding window, read from its transformers config.

A layer with window ``w`` lets the token at position p see the keys at positions
p - w < j <= p (transformers' ``sliding_window_overlay``); a full-attention layer
has window None. transformers spells the per-layer choice ``config.layer_types``
("sliding_attention" / "full_attention"; Qwen2 derives it from max_window_layers,
Gemma from its pattern); a config without it (Mistral) slides on every layer when
``sliding_window`` is set.
"""
from __future__ import annotations


def layer_windows(cfg) -> tuple[int | None, ...]:
    """The attention window of each layer (None: full attention)."""
    window = getattr(cfg, "sliding_window", None)
    n = cfg.num_hidden_layers
    if not window or getattr(cfg, "use_sliding_window", True) is False:   # Qwen's switch, off by default
        return (None,) * n
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (int(window),) * n
    if len(types) != n:
        raise ValueError(f"config.layer_types has {len(types)} entries for {n} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def kv_window(cfg) -> int | None:
    """The window beyond which a sequence's cached KV is never read again: the widest layer window
    when every layer slides (the layers share one block table), None when any layer reads it all."""
    windows = layer_windows(cfg)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
