"""The MLP activations of the models lmport runs, by their config names, as transformers computes them.

Not transformers' ``ACT2FN``: importing ``transformers.activations`` pulls in its hub-kernel registry and, with
it, torch's dynamo and distributed-tensor modules (seconds and about 170 MB of a process that only serves).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written out as transformers' ``NewGELUActivation`` does."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"), "gelu_new": _gelu_new,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names; ValueError naming it and the known ones otherwise."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not one lmport runs; known: {', '.join(ACTIVATIONS)}") from None
