"""Linear over GGUF block weights on every backend that declares block types
(``Capabilities.ggml_types``) against the reference (lmport.ops.ggml_linear, over gguf's dequantizer).

Matrix: every declared type, decode shapes (1, 4, 8 rows: the cpu kernel's integer path), batched
decode shapes (9, 40: weight tiles expanded in cache) and a prefill shape (129: dequantize + BLAS),
with and without bias. Weights are random blocks (tests/conformance/ggml_cases.py) with 99 output
rows, so no kernel's blocks of rows divide them; the K-quants get three 256-input blocks, the
32-input types nine. Under the Triton interpreter (cuda without a GPU) the shapes are cut to three.

Tolerance of the cpu kernel, derived as test_quant_linear.py derives its own: the weights expand
bit for bit (tested below), so what is left is float32 summation in another order than the
reference's, |error| <= K * 2^-24 * sum_k |x_k w_k|, and on the decode path the rounding of x to
int16 per run of 32 (step max|x_run| / 32767, at most half a step each), sum_k |w_k| * step_k / 2.
Up to ``quant_int8_rows()`` rows of x (AVX-512 VNNI), the types the kernel lists in ``ggml_int8_types``
(Q5_0, Q4_K, Q5_K, Q6_K) hold x as two int8 codes per input (int8_rows.h): a step of max|x_run| / (127 * 256), at most
one step each (the second code saturates at 127), sum_k |w_k| * step_k; and, tested apart, the
reference's own result at x so rounded. Each case runs again with the weight as the backend holds a
model's linears where that differs from the file's layout (cpu: Q5_0, Q4_K, Q5_K and Q6_K rows
interleaved in groups of 16), whose kernel holds x as the one-row path does for every step, a prefill's too: two int8
codes with AVX-512 VNNI, int16 on the AVX2 path (whose backend runs a prefill over them as a GEMM on the
dequantized weight, within the same bound); a prefill on AMX tiles rounds x and the weights to bfloat16
(test_quant_linear.py's held_rounding_bound).
"""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from ggml_cases import copied, random_blocks
from harness import op_backend
from lmport import ops
from lmport.platform.backend import Backend
from lmport.weights.ggml import HELD_BLOCK_TYPES
from test_quant_linear import (assert_bf16_prefill_is_the_reference, assert_each_rows_own_result,
                               bf16_rounding_bound, cpu_prefill, expanded_rounding_bound, float32_summation_bound,
                               held_rounding_bound, int8_pair_rounding_bound, int8_rows, int16_rounding_bound,
                               random_weight, rounded_as_held)

SHAPES = {"decode-1": 1, "decode-4": 4, "decode-8": 8, "batch-9": 9, "batch-40": 40, "prefill-129": 129}
OUT = 99
INTERLEAVED = ["q5_0", "q4_k", "q5_k", "q6_k"]   # the types the cpu backend holds interleaved (with its kernels)


def inputs(type_name: str) -> int:
    return HELD_BLOCK_TYPES[type_name].elements * (3 if HELD_BLOCK_TYPES[type_name].elements == 256 else 9)


def int8_types() -> set[str]:
    from lmport.backends.cpu import kernels
    return set(kernels.load().ggml_int8_types())


@pytest.fixture
def ggml_backend(backend_name, backend_class, record_property) -> Backend:
    """The backend on its device, under the Triton interpreter (cuda) or the simulated SDK."""
    if not backend_class.capabilities.ggml_types:
        pytest.skip(f"{backend_name} declares no GGUF block types")
    if backend_class.ggml_linear is Backend.ggml_linear:
        pytest.skip(f"{backend_name} runs the reference op itself (no kernel of its own to compare)")
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    return backend


@pytest.mark.parametrize("layout", ["file", "held"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("type_name", list(HELD_BLOCK_TYPES))
def test_ggml_linear_matches_the_reference(ggml_backend, type_name, shape, layout):
    """``held``: the weight in the layout the backend holds a model's linears in (Backend.hold_quantized), where
    that is not the file's (the cpu kernels' rows interleaved in groups of 16: 6 groups and 3 rows after)."""
    if type_name not in ggml_backend.capabilities.ggml_types:
        pytest.skip(f"{type_name} not declared")
    name = ggml_backend.capabilities.device_type
    if name != "cpu" and ggml_backend.device.type == "cpu" and shape not in ("decode-1", "batch-40"):
        # one row, and 40 rows in the 64-row tile larger batches take (16-row tiles: test_cuda_ggml.py)
        pytest.skip("the Triton interpreter is slow: two shapes keep the run short")
    weight = random_blocks(type_name, OUT, inputs(type_name))
    device = ggml_backend.device
    if layout == "held":
        held = ggml_backend.hold_quantized(copied(weight, device), torch.float32)
        if held.row_group == 1:
            pytest.skip(f"{name} holds {type_name} as the file lays it out")
        assert not torch.equal(held.blocks.cpu(), weight.blocks)
        weight = copied(held, "cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SHAPES[shape], weight.in_features, generator=g)
    bias = torch.randn(OUT, generator=g)
    w = ops.dequantize_ggml(weight)
    on_device = copied(weight, device)   # the reference below reads the host copy
    for b in (None, bias):
        got = ggml_backend.ggml_linear(x.to(device), on_device, None if b is None else b.to(device))
        want = ops.ggml_linear(x, weight, b)
        if weight.row_group != 1:   # rows interleaved: every step's x held as the one-row path holds it, or bf16
            bound = float32_summation_bound(x, w) + held_rounding_bound(x, w)
        else:
            int8_path = SHAPES[shape] <= int8_rows() and type_name in int8_types()
            rounding = int8_pair_rounding_bound if int8_path else int16_rounding_bound
            bound = float32_summation_bound(x, w) + (rounding(x, w) if shape.startswith("decode") else 0)
            bound += expanded_rounding_bound(x, w)
        if name != "cpu":   # float32 dot products of float32 weights: summation order only
            bound = float32_summation_bound(x, w)
        assert ((got.cpu() - want).abs() <= bound + 1e-6).all(), (got.cpu() - want).abs().max()


@pytest.mark.parametrize("type_name", list(HELD_BLOCK_TYPES))
def test_reference_dequantizer_is_gguf_bit_for_bit(type_name):
    weight = random_blocks(type_name, 5, inputs(type_name), seed=2)
    qtype = gguf.GGMLQuantizationType[type_name.upper()]
    want = gguf.quants.dequantize(weight.blocks.numpy(), qtype)
    got = ops.dequantize_ggml(weight).numpy()
    assert got.shape == (5, weight.in_features)
    assert np.array_equal(got.view(np.uint32), np.asarray(want, dtype=np.float32).view(np.uint32))


@pytest.mark.parametrize("layout", ["file", "held"])
@pytest.mark.parametrize("type_name", INTERLEAVED)
def test_cpu_one_row_path_is_the_reference_at_x_as_it_holds_it(type_name, layout):
    """One row of x over the interleaved types: the integer sums are exact, so the result is the
    reference's at x as the path holds it (two int8 codes with AVX-512 VNNI, int16 on the AVX2 path) up to
    float32 summation. Q4_K's and Q5_K's mins meet x's own sums (not the rounded x's), so here their blocks' dmin
    is zeroed. ``held``: rows interleaved as the backend holds a model's linears, where it does."""
    from lmport.backends.cpu import CpuBackend, kernels
    weight = random_blocks(type_name, OUT, inputs(type_name), seed=4)
    if type_name in ("q4_k", "q5_k"):
        weight.blocks.view(OUT, -1, HELD_BLOCK_TYPES[type_name].nbytes)[:, :, 2:4] = 0
    held = CpuBackend().hold_quantized(copied(weight), torch.float32) if layout == "held" else weight
    if layout == "held" and held.row_group == 1:
        pytest.skip(f"the cpu backend holds {type_name} as the file lays it out")
    x = torch.randn(1, weight.in_features, generator=torch.Generator().manual_seed(5))
    got = kernels.load().ggml_linear(x, held.blocks, type_name, weight.in_features, None, held.row_group)
    w = ops.dequantize_ggml(weight)
    want = (rounded_as_held(x).double() @ w.double().T).float()
    assert ((got - want).abs() <= float32_summation_bound(x, w) + 1e-6).all(), (got - want).abs().max()


@pytest.mark.parametrize("layout", ["file", "held"])
@pytest.mark.parametrize("type_name", INTERLEAVED)
def test_cpu_int8_rows_are_each_rows_own_result(type_name, layout):
    """A few rows of x over the int8 path's types: each row's result is the one it has alone, bit for bit.
    Rows interleaved as the backend holds them: each row's result is its own for every step, a batched decode or
    a prefill (259 rows: more than one of the kernel's chunks of rows), on every ISA's path
    (assert_each_rows_own_result)."""
    if layout == "file" and (type_name not in int8_types() or int8_rows() < 2):
        pytest.skip("this build runs no few-row int8 path (no AVX-512 VNNI)")
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, CpuBackend, kernels
    weight = random_blocks(type_name, OUT, inputs(type_name), seed=8)
    rows = int8_rows()
    if layout == "held":
        weight, rows = CpuBackend().hold_quantized(weight, torch.float32), 2 * SMALL_BATCH_TOKENS + 3
        assert weight.row_group == 16
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(9))

    def call(rows_of_x: torch.Tensor) -> torch.Tensor:
        return kernels.load().ggml_linear(rows_of_x, weight.blocks, type_name, weight.in_features, None,
                                          weight.row_group)

    if layout == "held":
        assert_each_rows_own_result(call, x)
    else:
        assert torch.equal(call(x), torch.cat([call(x[m:m + 1]) for m in range(len(x))]))


@pytest.mark.parametrize("type_name", INTERLEAVED)
def test_cpu_bf16_prefill_is_the_reference_within_bfloat16_rounding(type_name):
    """A prefill over interleaved rows on AMX tiles (LMPORT_CPU_PREFILL=bf16): within float32 summation and
    bfloat16 rounding of x and the weights of the reference, with and without bias, each row's result its own."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, CpuBackend, kernels
    file_rows = random_blocks(type_name, OUT, inputs(type_name), seed=12)
    weight = CpuBackend().hold_quantized(copied(file_rows), torch.float32)
    g = torch.Generator().manual_seed(13)
    x, bias = torch.randn(2 * SMALL_BATCH_TOKENS + 3, weight.in_features, generator=g), torch.randn(OUT, generator=g)
    w = ops.dequantize_ggml(file_rows)

    def call(rows_of_x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.load().ggml_linear(rows_of_x, weight.blocks, type_name, weight.in_features, b, weight.row_group)

    assert_bf16_prefill_is_the_reference(call, lambda b: ops.ggml_linear(x, file_rows, b), x, bias, w)


@pytest.mark.parametrize("precision", ["exact", "bf16"])
@pytest.mark.parametrize("type_name", ["q8_0", "q3_k"])
def test_cpu_prefill_over_rows_in_file_order(type_name, precision):
    """A prefill over a weight whose rows are in the file's order (Q8_0 as lmport loads it: int8 codes, a float16
    scale per 32 inputs, no mins), which the backend runs as a GEMM over the weight expanded to float32: the
    reference within float32 summation (exact, the default) and, under LMPORT_CPU_PREFILL=bf16, within bfloat16
    rounding of x and the weights too, with and without bias. The bfloat16 result is the reference's at x and the
    weights rounded to bfloat16 (nearest even) up to float32 summation: the products are taken in bfloat16, the
    sums and the result in float32. Skips bf16 on a CPU without bfloat16 products."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, CpuBackend
    backend = CpuBackend()
    if type_name == "q8_0":
        weight = dataclasses.replace(random_weight(8, 32, n=OUT, k=288, seed=14), zero_mins=True)
        w, reference = ops.dequantize(weight), lambda x, b: ops.quant_linear(x, weight, b)
        call = backend.quant_linear
    else:
        weight = random_blocks(type_name, OUT, inputs(type_name), seed=14)
        w, reference = ops.dequantize_ggml(weight), lambda x, b: ops.ggml_linear(x, weight, b)
        call = backend.ggml_linear
    assert weight.row_group == 1 and backend.prefill_expands(weight)
    g = torch.Generator().manual_seed(15)
    x, bias = torch.randn(2 * SMALL_BATCH_TOKENS + 3, weight.in_features, generator=g), torch.randn(OUT, generator=g)
    with cpu_prefill(precision):
        for b in (None, bias):
            got, want = call(x, weight, b), reference(x, b)
            bound = float32_summation_bound(x, w)
            if precision == "bf16":
                rounded = (x.bfloat16().double() @ w.bfloat16().double().T).float()
                rounded = rounded if b is None else rounded + b
                assert ((got - rounded).abs() <= bound + 1e-6).all(), (got - rounded).abs().max()
                bound = bound + bf16_rounding_bound(x, w)
            assert ((got - want).abs() <= bound + 1e-6).all(), (got - want).abs().max()


@pytest.mark.parametrize("type_name", list(HELD_BLOCK_TYPES))
def test_cpu_kernel_takes_no_rows(type_name):
    """No row of x (an expert no token was routed to): an empty result, on every path."""
    from lmport.backends.cpu import kernels
    weight = random_blocks(type_name, OUT, inputs(type_name), seed=8)
    got = kernels.load().ggml_linear(torch.empty(0, weight.in_features), weight.blocks, type_name,
                                     weight.in_features, None)
    assert got.shape == (0, OUT)


def test_cpu_kernel_runs_what_the_backend_declares():
    from lmport.backends.cpu import CpuBackend, kernels
    assert set(kernels.load().ggml_types()) == CpuBackend.capabilities.ggml_types


@pytest.mark.parametrize("type_name", list(HELD_BLOCK_TYPES))
def test_cpu_dequantize_kernel_is_the_reference_bit_for_bit(type_name):
    from lmport.backends.cpu import CpuBackend, kernels
    weight = random_blocks(type_name, OUT, inputs(type_name), seed=3)
    want = ops.dequantize_ggml(weight).view(torch.int32)
    for w in (weight, CpuBackend().hold_quantized(copied(weight), torch.float32)):   # the file's rows, and as held
        got = kernels.load().ggml_dequantize(w.blocks, type_name, w.in_features, w.row_group)
        assert torch.equal(got.view(torch.int32), want)
        assert torch.equal(ops.dequantize_ggml(w).view(torch.int32), want)


def test_cpu_kernel_refuses_rows_interleaved_where_it_has_no_layout():
    from lmport.backends.cpu import kernels
    weight = random_blocks("q2_k", 32, 256)
    for call in (lambda: kernels.load().ggml_linear(torch.randn(1, 256), weight.blocks, "q2_k", 256, None, 16),
                 lambda: kernels.load().ggml_dequantize(weight.blocks, "q2_k", 256, 16)):
        with pytest.raises(RuntimeError, match="q2_k rows interleaved in groups of 16: this build reads groups"):
            call()


def test_cpu_kernel_names_a_shape_it_does_not_take():
    from lmport.backends.cpu import kernels
    weight = random_blocks("q4_k", 4, 512)
    with pytest.raises(RuntimeError, match=r"q4_k blocks of 256 inputs must be \[out, 144\]"):
        kernels.load().ggml_linear(torch.randn(1, 256), weight.blocks, "q4_k", 256, None)
    with pytest.raises(RuntimeError, match="no kernel for GGML type 'q8_0'"):
        kernels.load().ggml_linear(torch.randn(1, 512), weight.blocks, "q8_0", 512, None)


def test_undeclared_type_runs_the_reference(backend_name, monkeypatch):
    """A type missing from the backend's ggml_types runs the reference op; on cpu, where every type is
    declared, the declaration is narrowed to check that the method reads it."""
    backend, _ = op_backend(backend_name)
    declared = backend.capabilities.ggml_types
    if backend_name == "cpu":
        from lmport.backends.cpu import kernels
        narrowed = dataclasses.replace(backend.capabilities, ggml_types=declared - {"q4_k"})
        monkeypatch.setattr(backend, "capabilities", narrowed)
        compiled = kernels.load()

        def refused(*args, **kwargs):
            raise AssertionError("the kernel ran a type the backend does not declare")
        monkeypatch.setattr(compiled, "ggml_linear", refused)
        monkeypatch.setattr(compiled, "ggml_dequantize", refused)
        undeclared = ["q4_k"]
    else:
        undeclared = sorted(set(HELD_BLOCK_TYPES) - declared)[:1]
    if not undeclared:
        pytest.skip(f"{backend_name} declares every block type")
    weight = random_blocks(undeclared[0], OUT, inputs(undeclared[0]))
    x = torch.randn(2, weight.in_features)
    on_device = dataclasses.replace(weight, blocks=weight.blocks.to(backend.device))
    got = backend.ggml_linear(x.to(backend.device), on_device, None)
    torch.testing.assert_close(got.cpu().float(), ops.ggml_linear(x, weight), atol=1e-5, rtol=1e-5)


def test_cpu_other_shapes_and_dtypes():
    """x with leading axes is flattened for the kernel; float64 x runs the reference."""
    from lmport.backends.cpu import CpuBackend
    backend = CpuBackend()
    weight = random_blocks("q6_k", OUT, 512)
    x = torch.randn(2, 3, 512)
    got = backend.ggml_linear(x, weight)
    assert got.shape == (2, 3, OUT)
    torch.testing.assert_close(got, ops.ggml_linear(x, weight), atol=1e-3, rtol=1e-4)
    x64 = x.double()
    assert torch.equal(backend.ggml_linear(x64, weight), ops.ggml_linear(x64, weight))
