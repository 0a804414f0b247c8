"""The parameter count of a model (or of one tensor-parallel rank's shard), from its config alone."""
from __future__ import annotations

import torch

from lmport.models.architectures import model_class
from lmport.parallel import TPGroup


def count_parameters(model_cfg, tp: TPGroup | None = None) -> int:
    """Parameters the engine loads (on rank ``tp.rank`` of ``tp.size``): its model built on the meta device
    (no memory), tied embeddings once."""
    with torch.device("meta"):
        model = model_class(model_cfg)(model_cfg, backend=None, rotary=None, tp=tp)
    count = sum(p.numel() for p in model.parameters())
    if getattr(model_cfg, "tie_word_embeddings", False):
        count -= model.lm_head.weight.numel()
    return count
