"""Online KV-cache quantization (quant_policy 8, 4 and "fp8"), the reference scheme.

Per token and per KV head, over head_dim, asymmetric min/max:

    scale = max(max - min, eps) / (2**bits - 1)       stored, rounded up, in param dtype
    zero  = round(-min / scale)                        an integer, stored in param dtype
    q     = clamp(round(x / scale) + zero, 0, 2**bits - 1)
    x'    = (q - zero) * scale                         |x - x'| <= scale / 2

The zero point is an integer so that it is exact in float16 (integers up to
2048 are); when ``|min| / scale`` would exceed ``ZERO_LIMIT`` (a vector far
from 0 with a tiny range, e.g. a constant one) the scale is widened to
``|min| / ZERO_LIMIT``, which keeps the bound above. ``eps`` is the smallest
normal number of the param dtype times the number of levels, so the scale
never underflows and nothing divides by zero.

The param dtype is float16 for 16-bit caches and float32 for float32 caches;
scale and zero sit side by side, ``qparams[..., 0] = scale`` and
``qparams[..., 1] = zero``. A scale beyond the param dtype's largest finite
value (a bfloat16 vector whose range exceeds about 65504 * (2**bits - 1)) is
clamped to it and the zero to +-ZERO_LIMIT: such values saturate, finite,
instead of turning into inf and NaN; the bound above holds below that range.

INT4 packs two values a byte: element ``2i`` in the low nibble, ``2i + 1`` in
the high nibble. Every backend uses this same order.

quant_policy "fp8" (LMDeploy's name; vLLM's ``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``) keeps each value as
one float8 e4m3 (OCP e4m3fn: 4 exponent bits, 3 mantissa bits, largest finite 448) with a float32 scale per
KV head held beside the layer's cache, not per row, so a row costs exactly half of a 16-bit one:

    code = e4m3( clamp(x / scale, -448, 448) )          round to nearest, ties to even (torch's cast)
    x'   = float(code) * scale

The clamp saturates values beyond 448 * scale instead of letting the cast make them NaN. The scale is 1.0
unless a checkpoint provides one (vLLM's default without calibration).
"""
from __future__ import annotations

import torch

ZERO_LIMIT = 2047

FP8 = "fp8"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Every quant_policy EngineConfig takes once its aliases are resolved; "fp8_e4m3" names the same format as "fp8".
POLICIES = (0, 8, 4, FP8)
FP8_ALIASES = ("fp8", "fp8_e4m3")


def is_fp8(quant_policy) -> bool:
    return quant_policy == FP8


def has_codes(quant_policy) -> bool:
    """Whether the cache holds integer codes with a scale and zero a row (INT8, INT4)."""
    return quant_policy in (4, 8)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 codes of ``x`` [..., H, D] with a float32 scale per head ``scale`` [H]."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`, returning ``dtype``."""
    return (codes.float() * scale[:, None]).to(dtype)


def param_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype of an INT8/INT4 cache's scale and zero."""
    return torch.float32 if cache_dtype == torch.float32 else torch.float16


def packed_dim(head_dim: int, quant_policy: int | str) -> int:
    if quant_policy == 4:
        if head_dim % 2:
            raise ValueError(f"quant_policy=4 packs two values a byte and needs an even head_dim, got {head_dim}")
        return head_dim // 2
    return head_dim


def quantize(x: torch.Tensor, bits: int, pdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last axis of ``x``. Returns (uint8 values, qparams [..., 2])."""
    levels = (1 << bits) - 1
    xf = x.float()
    lo = xf.amin(-1, keepdim=True)
    hi = xf.amax(-1, keepdim=True)
    eps = torch.finfo(pdtype).tiny * levels
    # Divided by tensors, not Python numbers: CUDA turns a division by a number into a product with its
    # reciprocal, a bit off the true quotient that the CPU and the fill kernels compute.
    scale = torch.maximum((hi - lo).clamp_min(eps) / torch.full_like(lo, levels),
                          lo.abs() / torch.full_like(lo, ZERO_LIMIT))
    # Round the stored scale up, never down, so the range still fits in the levels.
    scale = (scale * (1 + 2.0 ** -9)).clamp_(max=torch.finfo(pdtype).max).to(pdtype).float()
    # The clamp only bites when the scale was clamped: saturate, never overflow the param dtype.
    zero = torch.round(-lo / scale).clamp_(-ZERO_LIMIT, ZERO_LIMIT)
    q = (torch.round(xf / scale) + zero).clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, torch.cat([scale, zero], dim=-1).to(pdtype)


def dequantize(q: torch.Tensor, qparams: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`, returning ``dtype``."""
    if bits == 4:
        q = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)
    scale = qparams[..., 0:1].float()
    zero = qparams[..., 1:2].float()
    return ((q.float() - zero) * scale).to(dtype)
