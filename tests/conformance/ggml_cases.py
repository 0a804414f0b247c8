"""Random GGUF block weights for the ggml_linear cases (lmport.weights.ggml).

Every byte of a block is random except its float16 fields (the super-scale d, and dmin or m where
the type has one), which are set to small finite values, and MXFP4's e8m0 scale byte, set to a small power of
two, so the dequantized weights are of order 1 whatever the codes and sub-scales are.
"""
from __future__ import annotations

import dataclasses

import torch

from lmport.weights import tensors
from lmport.weights.ggml import HELD_BLOCK_TYPES, GGMLWeight

# Byte offsets of each block's float16 fields (llama.cpp's ggml-common.h).
HALF_FIELDS = {"q5_0": (0,), "q5_1": (0, 2), "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2),
               "q6_k": (208,), "iq4_nl": (0,), "iq4_xs": (0,), "mxfp4": ()}
# The largest |code * sub-scale| of each type: d of about 1 / CODE_RANGE gives weights of order 1.
CODE_RANGE = {"q5_0": 16, "q5_1": 31, "q2_k": 45, "q3_k": 128, "q4_k": 945, "q5_k": 1953, "q6_k": 4096,
              "iq4_nl": 127, "iq4_xs": 4064, "mxfp4": 12}


def random_blocks(type_name: str, out_features: int, in_features: int, seed: int = 0) -> GGMLWeight:
    """A weight [out_features, in_features] of random blocks of ``type_name``; each float16 field is
    (0.5 .. 1.5) / CODE_RANGE with a random sign (a negative dmin or m is as valid as a positive one); MXFP4's
    scale byte e is 122 .. 125 (scales 2^-6 .. 2^-3)."""
    t = HELD_BLOCK_TYPES[type_name]
    g = torch.Generator().manual_seed(seed)
    nblocks = in_features // t.elements
    blocks = torch.randint(0, 256, (out_features, nblocks, t.nbytes), generator=g, dtype=torch.uint8)
    for offset in HALF_FIELDS[type_name]:
        sign = torch.randint(0, 2, (out_features, nblocks), generator=g) * 2 - 1
        d = (sign * (torch.rand(out_features, nblocks, generator=g) + 0.5) / CODE_RANGE[type_name]).half()
        blocks[:, :, offset:offset + 2] = d.view(torch.uint8).reshape(out_features, nblocks, 2)
    if type_name == "mxfp4":
        blocks[:, :, 0] = torch.randint(122, 126, (out_features, nblocks), generator=g, dtype=torch.uint8)
    return GGMLWeight(blocks.reshape(out_features, nblocks * t.nbytes), type_name, in_features).check()


def copied(weight, device: torch.device | str | None = None):
    """A quantized weight with its own copies of the tensors (on ``device``, where given): what a backend's
    hold_quantized may relay in place is then not the original, which a test still reads."""
    return dataclasses.replace(weight, **{name: t.to(device, copy=True) for name, t in tensors(weight).items()})
