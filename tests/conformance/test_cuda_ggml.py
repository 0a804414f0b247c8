"""The cuda backend's GGUF block kernel (lmport/backends/cuda/ggml_linear.py) against the reference op.

Every type the backend declares in ``Capabilities.ggml_types``, x of 1, 3 and 17 rows in float32,
float16 and bfloat16, with and without bias, on weights of random blocks (ggml_cases.py: every byte
random except the float16 scales, which are set to finite values of either sign). 70 output rows
cross a 64-row tile; the K-quants get two 256-input blocks, the 32-input types four. Without a GPU
the kernel runs under the Triton interpreter (tests/conftest.py); with one, natively, and on larger
shapes too.

Tolerance, derived: the kernel rounds each weight to x's dtype as the reference does, sums exact
products in fp32 in another order and rounds the result once. So against the exact sum of
x * w (w = ``ops.dequantize_ggml(weight, x.dtype)``), |error| <= K * 2^-24 * sum |x w| (the fp32
summation, any order) + half a unit in the last place of x's dtype. On a GPU the compiler may
contract a dequantizing multiply-add into an FMA, which can move a weight by one unit of x's
dtype; that adds eps(dtype) * sum |x w| there.
"""
from __future__ import annotations

import pytest
import torch

from ggml_cases import random_blocks
from harness import op_backend
from lmport import ops
from lmport.backends.cuda import CudaBackend
from lmport.weights.ggml import BLOCK_TYPES, GGMLWeight

TYPES = sorted(CudaBackend.capabilities.ggml_types)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Every type at float16 and every dtype at q4_k in the default run: a type's dequantization and x's dtype are
# separate parts of the one kernel. Every pair under the slow mark (the Triton interpreter takes seconds each).
PAIRS = [pytest.param(t, d, marks=() if d == torch.float16 or t == "q4_k" else pytest.mark.slow,
                      id=f"{t}-{d}") for t in TYPES for d in DTYPES]


@pytest.fixture(scope="module")
def cuda():
    """(backend, mode): mode "native" on a GPU, "interpreter" otherwise."""
    return op_backend("cuda")


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unit in the last place of dtype at |v| (float64)."""
    tiny = torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(tiny))))


def check(got: torch.Tensor, x: torch.Tensor, weight: GGMLWeight, bias: torch.Tensor | None, native: bool):
    dtype = x.dtype
    assert got.dtype == dtype and got.shape == (*x.shape[:-1], weight.out_features)
    x = x.reshape(-1, x.shape[-1]).cpu().double()
    got = got.reshape(x.shape[0], -1).cpu().double()
    w = ops.dequantize_ggml(weight, dtype).cpu().double()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.cpu().double()
    exact = x @ w.T + b
    magnitude = x.abs() @ w.abs().T + b.abs()
    bound = x.shape[1] * 2.0 ** -24 * magnitude + 0.5 * ulp(torch.maximum(exact.abs(), got.abs()), dtype)
    if native:
        bound += torch.finfo(dtype).eps * magnitude
    excess = (got - exact).abs() - bound
    assert torch.isfinite(got).all()
    assert (excess <= 0).all(), f"{weight.type_name} {dtype}: error exceeds the bound by {excess.max().item():.3g}"
    # And the reference op itself (the ground truth of every backend): within one more rounding of it.
    # On the host: x is there already, and a GPU's blocks would make the reference a mixed-device matmul.
    host_weight = GGMLWeight(weight.blocks.cpu(), weight.type_name, weight.in_features)
    want = ops.ggml_linear(x.to(dtype), host_weight, None if bias is None else bias.cpu()).double()
    assert ((got - want).abs() <= 2 * bound + ulp(want, dtype)).all()


@pytest.mark.parametrize("type_name,dtype", PAIRS)
def test_ggml_linear_matches_the_reference(cuda, type_name, dtype):
    backend, mode = cuda
    k = 512 if BLOCK_TYPES[type_name].elements == 256 else 128
    weight = random_blocks(type_name, 70, k)
    weight = GGMLWeight(weight.blocks.to(backend.device), type_name, k)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(70, generator=g).to(dtype).to(backend.device)
    for rows, b in ((1, None), (3, bias), (17, None)):
        x = torch.randn(rows, k, generator=g).to(dtype).to(backend.device)
        check(backend.ggml_linear(x, weight, b), x, weight, b, mode == "native")


def test_ggml_linear_keeps_leading_dims(cuda):
    """A [batch, tokens, in] x (a module's input) comes back [batch, tokens, out]."""
    backend, mode = cuda
    weight = random_blocks("q4_k", 40, 256, seed=2)
    weight = GGMLWeight(weight.blocks.to(backend.device), "q4_k", 256)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(3)).to(backend.device)
    check(backend.ggml_linear(x, weight), x, weight, None, mode == "native")


def test_gpu_decode_tile(cuda, monkeypatch):
    """The tile a GPU takes for decode (32 weight rows a program), run here too."""
    backend, mode = cuda
    from lmport.backends.cuda import ggml_linear
    monkeypatch.setattr(ggml_linear, "tiles", lambda m: (16, 32))
    weight = random_blocks("q6_k", 70, 256, seed=5)
    weight = GGMLWeight(weight.blocks.to(backend.device), "q6_k", 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6)).to(backend.device)
    check(backend.ggml_linear(x, weight), x, weight, None, mode == "native")


def test_ggml_types_are_the_kernels():
    """What the backend declares is exactly what the kernel module runs (read without importing triton)."""
    from lmport.backends.cuda import ggml_linear  # TRITON_INTERPRET: tests/conftest.py
    assert CudaBackend.capabilities.ggml_types == ggml_linear.TYPES
    assert ggml_linear.TYPES <= set(BLOCK_TYPES)


# On a GPU: serving shapes (decode 1-16 rows, a batched step, a prefill chunk) on every type.
NATIVE_SHAPES = [(1, 2048, 1024), (16, 4096, 512), (61, 1536, 768), (300, 2048, 2048)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("type_name", TYPES)
def test_ggml_linear_native_shapes(cuda, type_name, dtype):
    backend, mode = cuda
    if mode != "native":
        pytest.skip("GPU shapes: too slow for the Triton interpreter (the small cases above run it)")
    g = torch.Generator().manual_seed(4)
    for rows, k, n in NATIVE_SHAPES:
        weight = random_blocks(type_name, n, k, seed=rows)
        weight = GGMLWeight(weight.blocks.to(backend.device), type_name, k)
        x = torch.randn(rows, k, generator=g).to(dtype).to(backend.device)
        bias = torch.randn(n, generator=g).to(dtype).to(backend.device)
        check(backend.ggml_linear(x, weight, bias), x, weight, bias, native=True)
