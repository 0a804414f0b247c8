"""Host-side helpers shared by the kernel wrappers: dtypes, tile sizes, interpreter mode.

Imported only together with the kernels (it imports triton). Whether the
kernels run under the Triton interpreter is fixed when this module is first
imported, which is when the ``@triton.jit`` decorators of the kernel modules run.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lmport.kv import quant
from lmport.kv.layout import LayerCache

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
}


def tl_dtype(dtype: torch.dtype):
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"cuda kernels support float16, bfloat16 and float32, got {dtype}") from None


def dot_args(dtype: torch.dtype) -> tuple:
    """(operand dtype, input precision) for ``tl.dot`` on ``dtype`` inputs.

    float32 uses IEEE products (not TF32) so fp32 models match the reference.
    The interpreter multiplies bfloat16 as raw uint16, so there bf16 operands
    are widened to fp32 first: bf16 x bf16 products are exact in fp32, which
    is what tensor cores compute too.
    """
    if dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16):
        return tl.float32, "ieee"
    return tl_dtype(dtype), "tf32"  # "tf32" is the default and is ignored for 16-bit inputs


# The kernels' QUANT for an fp8 cache (0, 8 and 4 are the policies' own numbers).
QUANT_FP8 = 1


def kernel_quant(cache: LayerCache) -> int:
    """The kernels' QUANT constant for ``cache``: 0, 8, 4, or QUANT_FP8."""
    return QUANT_FP8 if quant.is_fp8(cache.quant_policy) else int(cache.quant_policy)


def cache_values(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the kernels address them: an fp8 cache as its bytes, which the kernels encode and decode
    themselves (no float8 type, so no fp8 hardware, is needed)."""
    k, v = cache.k, _paired_v(cache)
    if quant.is_fp8(cache.quant_policy):
        return k.view(torch.uint8), v.view(torch.uint8)
    return k, v


def _paired_v(cache: LayerCache) -> torch.Tensor:
    if cache.v is None:
        raise ValueError(f"the cuda attention and fill kernels take paged K and V; this layer caches a {cache.kind}")
    return cache.v


def qparam_args(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(K params, V params, their strides) for a kernel. An fp8 cache passes its per-head scales as params
    whose block, slot and (scale, zero) strides are 0: a row's "scale" and "zero" both read its head's scale.
    An unquantized cache passes its own K and V as placeholders with zero strides: the kernel (QUANT=0) never
    reads them."""
    if quant.is_fp8(cache.quant_policy) and cache.k_scale is not None and cache.v_scale is not None:
        return cache.k_scale, cache.v_scale, (0, 0, cache.k_scale.stride(0), 0)
    if cache.k_qparams is not None and cache.v_qparams is not None and cache.quant_policy:
        return cache.k_qparams, cache.v_qparams, cache.k_qparams.stride()
    return cache.k, _paired_v(cache), (0, 0, 0, 0)


def new_kv_args(q: torch.Tensor, cache: LayerCache, new_kv: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, int, int, int, bool]:
    """(new K, new V, their token, head and dim strides, NEW) for the attention kernels: over a quantized cache the
    step's tokens attend to their K and V as computed (lmport.ops.attention); otherwise q stands in, never read."""
    if new_kv is None or not cache.quant_policy:
        return q, q, 0, 0, 0, False
    k, v = new_kv
    v = v if v.stride() == k.stride() else v.contiguous()
    k = k if v.stride() == k.stride() else k.contiguous()
    token, head, dim = k.stride()
    return k, v, token, head, dim, True


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors: how many programs fill the GPU once.

    Under the interpreter every program is run in Python one after another, so
    a small number keeps split-K (and the tests of it) cheap.
    """
    if device.type != "cuda" or INTERPRETED:
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
