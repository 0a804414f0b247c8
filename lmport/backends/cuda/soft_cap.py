"""Triton helper: Gemma 2's attention-logit soft cap on base-2 scaled scores.

The kernels keep scores multiplied by log2(e) (for exp2); the cap applies to the
natural scores: s -> softcap * tanh(s / softcap), tanh(x) written as
1 - 2 / (exp(2x) + 1), which saturates to +-1 instead of overflowing.
"""
from __future__ import annotations

import triton
import triton.language as tl

# A constexpr: a jit function may read a module global only when it is one.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def soft_cap_log2(s_log2, softcap):
    x = s_log2 / (LOG2E * softcap)
    return softcap * LOG2E * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
