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


def qparam_args(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(K params, V params, their strides) for a kernel. An unquantized cache passes its own K and V as
    placeholders with zero strides: the kernel (QUANT=0) never reads them."""
    if cache.k_qparams is not None and cache.v_qparams is not None and cache.quant_policy:
        return cache.k_qparams, cache.v_qparams, cache.k_qparams.stride()
    return cache.k, cache.v, (0, 0, 0, 0)


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
