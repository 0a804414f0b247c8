"""Quantized linear on every backend against the reference (lmport.ops.quant_linear), and the
refusal of a quantized checkpoint on backends that declare no weight formats.

Matrix: 4- and 8-bit, group sizes 32/64/128, decode shapes (1, 4, 8 rows: the cpu kernel's
integer path), batched decode shapes (9, 40 rows: the cpu kernel's weight tiles expanded in cache)
and a prefill shape (129 rows: dequantize + BLAS), with and without bias; on cpu, group 32 weights
have 288 inputs, an odd number of runs of 32 (the AVX-512 path takes runs in pairs or fours), and weights
have 99 outputs, so one row of x meets a last block of fewer than its 8 weight rows.
Tolerance of the cpu kernels, derived rather than picked: float32 summation in another order than
the reference's, |error| <= K * 2^-24 * sum_k |x_k w_k|; the decode path also rounds x to int16
per run of 32 (step max|x_run| / 32767, error at most half a step), adding sum_k |w_k| * step_k / 2.
Up to the rows the kernel names in ``quant_int8_rows`` (8 with AVX-512 VNNI, 0 on the AVX2 path) it holds x as two
int8 codes an input instead (quant_linear.h): a step of max|x_run| / (127 * 256), at most one step
each (the second code saturates at 127), sum_k |w_k| * step_k; and, tested apart, the reference's
own result at x so rounded. Rows interleaved as the backend holds them (``held``) take every row of x,
a prefill's too, as the build's one-row path holds it: two int8 codes with AVX-512 VNNI, int16 on the
AVX2 path (whose backend runs a prefill over them as a GEMM on the dequantized weight, within the same bound);
from the rows the kernel names in ``interleaved_bf16_rows`` (a prefill, on a machine with AMX tiles) x and the
weights rounded to bfloat16 instead, each product within 2^-8 of itself. A prefill's GEMM over the expanded weight
rounds them so too under LMPORT_CPU_PREFILL=bf16 where the CPU has bfloat16 products (``expanded_rounding_bound``).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from lmport import ops
from lmport.platform.backend import Backend
from lmport.config import ConfigError, EngineConfig
from lmport.weights.format import from_codes
from ggml_cases import copied
from harness import op_backend

SHAPES = {"decode-1": 1, "decode-4": 4, "decode-8": 8, "batch-9": 9, "batch-40": 40, "prefill-129": 129}


def random_weight(bits: int, group: int, n: int = 96, k: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randint(0, 16, (n, k), generator=g) if bits == 4
             else torch.randint(-128, 128, (n, k), generator=g))
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    mins = -torch.rand(n, k // group, generator=g) * 0.1 * (bits == 4)
    return from_codes(codes, scales, mins, bits, group)


def float32_summation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|error| of a float32 dot product of K terms in any order: at most K * 2^-24 * sum_k |x_k w_k|."""
    return x.shape[1] * 2.0 ** -24 * (x.abs() @ w.abs().T)


def int16_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    step = x.abs().reshape(x.shape[0], -1, 32).amax(-1) / 32767          # [M, runs]
    per_input = step.repeat_interleave(32, dim=1) / 2                     # [M, K]
    return per_input @ w.abs().T


def int8_pair_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    step = x.abs().reshape(x.shape[0], -1, 32).amax(-1) / (127 * 256)           # [M, runs]
    return step.repeat_interleave(32, dim=1) @ w.abs().T


def bf16_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x and w each rounded to bfloat16 (at most 2^-9 of itself each): every product within 2^-8 + 2^-18 of
    itself, sum_k |x_k w_k| (2^-8 + 2^-18)."""
    return (2.0 ** -8 + 2.0 ** -18) * (x.abs() @ w.abs().T)


def bf16_rows() -> int:
    """The rows of x from which the cpu kernels take bfloat16 products over interleaved rows (0: never)."""
    from lmport.backends.cpu import kernels
    return kernels.load().interleaved_bf16_rows()


@contextlib.contextmanager
def cpu_prefill(precision: str, tiles: bool = False):
    """The cpu backend's prefills at ``precision`` inside the block, as LMPORT_CPU_PREFILL sets them: under 'auto'
    the kernels' prefills over interleaved rows on AMX tiles in bfloat16, under 'bf16' the prefill GEMMs over
    float32 weights (expanded ones too) as well. 'bf16' skips where the CPU has no bfloat16 products, or, with
    ``tiles``, where the CPU or build has no AMX tiles."""
    from lmport.backends.cpu import kernels
    module = kernels.load()
    try:
        on_tiles, on_gemm = module.set_bf16_prefill(precision != "exact"), kernels.set_bf16_gemm(precision == "bf16")
        if precision == "bf16" and not on_tiles and tiles:
            pytest.skip("no AMX tiles on this CPU (or build)")
        if precision == "bf16" and not on_gemm:
            pytest.skip("no bfloat16 products on this CPU (AMX or AVX512_BF16)")
        yield
    finally:
        kernels.configured(module, kernels.prefill_precision())


def bf16_prefill():
    """The cpu kernels' prefills over interleaved rows on AMX tiles in bfloat16 (LMPORT_CPU_PREFILL=bf16) inside
    the block; skips where the CPU or build has no tiles."""
    return cpu_prefill("bf16", tiles=True)


def expanded_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the cpu backend's prefill GEMM over a weight expanded to float32 adds to float32 summation: bfloat16
    rounding where it computes in bfloat16 (LMPORT_CPU_PREFILL=bf16 on a CPU with bfloat16 products), else 0."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, kernels
    if kernels.bf16_gemm() and x.shape[0] > SMALL_BATCH_TOKENS:
        return bf16_rounding_bound(x, w)
    return torch.zeros(x.shape[0], w.shape[0])


def held_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the cpu kernels' rounding of x (and, on AMX tiles, of w) adds over rows interleaved in groups."""
    if 0 < bf16_rows() <= x.shape[0]:
        return bf16_rounding_bound(x, w)
    return int8_pair_rounding_bound(x, w) if int8_rows() > 0 else int16_rounding_bound(x, w)


def assert_each_rows_own_result(call, x: torch.Tensor) -> None:
    """``call`` over rows interleaved in groups: up to a decode step's rows of x each row's result is the one it
    has alone, bit for bit (a batched decode does not change a sequence's logits); from the rows where the build
    takes bfloat16 products (``bf16_rows``, a prefill) each row's is the one it has in any other such prefill."""
    first_bf16 = bf16_rows()
    decode = len(x) if first_bf16 == 0 else min(len(x), first_bf16 - 1)
    assert torch.equal(call(x[:decode]), torch.cat([call(x[m:m + 1]) for m in range(decode)]))
    if 0 < first_bf16 and 2 * first_bf16 <= len(x):
        assert torch.equal(call(x), torch.cat([call(x[:first_bf16]), call(x[first_bf16:])]))


def assert_bf16_prefill_is_the_reference(call, reference, x: torch.Tensor, bias: torch.Tensor, w: torch.Tensor) -> None:
    """``call(x, b)`` (a kernel over interleaved rows) with bfloat16 prefills on: the reference's ``reference(b)``
    within float32 summation and bfloat16 rounding of x and ``w`` (the dequantized weight), with and without
    ``bias``, each row's result its own (assert_each_rows_own_result). Skips without AMX tiles."""
    with bf16_prefill():
        for b in (None, bias):
            got, want = call(x, b), reference(b)
            bound = float32_summation_bound(x, w) + bf16_rounding_bound(x, w)
            assert ((got - want).abs() <= bound + 1e-6).all(), (got - want).abs().max()
        assert_each_rows_own_result(call, x)


def rounded_to_int16(x: torch.Tensor) -> torch.Tensor:
    """x as the AVX2 path's integer kernels hold it, as float: per run of 32, d = max|x_run| / 32767 and
    x / d (a float32 product by 1 / d) rounded to nearest even, x = d q."""
    runs = x.reshape(x.shape[0], -1, 32)
    d = runs.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(runs * inv).double() * d.double()).reshape(x.shape).float()


def rounded_as_held(x: torch.Tensor) -> torch.Tensor:
    """x as the cpu kernels' one-row path holds it: two int8 codes with AVX-512 VNNI, int16 on the AVX2 path."""
    return rounded_to_int8_pairs(x) if int8_rows() > 0 else rounded_to_int16(x)


def rounded_to_int8_pairs(x: torch.Tensor) -> torch.Tensor:
    """x as the one-row int8 paths hold it, as float: per run of 32, d = max|x_run| / 127, hi = x / d and
    lo = (x - hi d) / (d / 256) rounded to nearest even (lo saturated to int8), x = d (256 hi + lo) / 256.
    The arithmetic is the kernels': float32 products by 1 / d and 256 / d, x - hi d rounded once (an FMA)."""
    runs = x.reshape(x.shape[0], -1, 32)
    d = runs.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    hi = torch.round(runs * inv)
    rest = (runs.double() - hi.double() * d.double()).float()
    lo = torch.round(rest * (256 * inv)).clamp(-128, 127)
    return ((256 * hi + lo).double() * (d.double() / 256)).reshape(x.shape).float()


def int8_rows() -> int:
    """The rows of x up to which the cpu kernel holds x as two int8 codes (0 on the AVX2 path)."""
    from lmport.backends.cpu import kernels
    return kernels.load().quant_int8_rows()


# Activation dtype each backend's own kernel takes (ascend's op takes float16 / bfloat16 only).
DTYPES = {"cpu": torch.float32, "ascend": torch.float16, "cuda": torch.float32}


@pytest.fixture
def native_backend(backend_name, backend_class, record_property) -> Backend:
    """The backend on its device, under the Triton interpreter (cuda) or the simulated SDK (ascend)."""
    caps = backend_class.capabilities
    if not caps.weight_formats:
        pytest.skip(f"{backend_name} declares no weight formats (its refusal is tested below)")
    if backend_class.quant_linear is Backend.quant_linear:
        pytest.skip(f"{backend_name} runs the reference op itself (no kernel of its own to compare)")
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    return backend


@pytest.mark.parametrize("layout", ["rows", "held"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_quant_linear_matches_the_reference(native_backend, bits, group, shape, layout):
    """``held``: the weight as the backend holds a model's linears where that differs (cpu: rows interleaved in
    groups of 16, 6 groups and 3 rows after them, x held as the one-row path holds it for every step, a
    prefill's too)."""
    if group not in native_backend.capabilities.weight_group_sizes:
        pytest.skip(f"group {group} not declared")
    name = native_backend.capabilities.device_type
    if name == "cuda" and native_backend.device.type == "cpu" and (group == 64 or shape in ("decode-8", "batch-40")):
        pytest.skip("the Triton interpreter is slow: groups 32/128 and three shapes keep make test short")
    weight = random_weight(bits, group, n=99 if name == "cpu" else 96, k=288 if name == "cpu" and group == 32 else 256)
    if layout == "held":
        held = native_backend.hold_quantized(weight, DTYPES[name])
        if held is weight:
            pytest.skip(f"{name} holds int{bits} weights as they are")
        weight = held
    g = torch.Generator().manual_seed(1)
    dtype = DTYPES[name]
    x = torch.randn(SHAPES[shape], weight.in_features, generator=g).to(dtype)
    bias = torch.randn(weight.out_features, generator=g).to(dtype)
    device = native_backend.device
    on_device = copied(weight, device)   # the reference below reads the host copy
    for b in (None, bias):
        got = native_backend.quant_linear(x.to(device), on_device, None if b is None else b.to(device)).cpu()
        want = ops.quant_linear(x.float(), weight, None if b is None else b.float())
        if name == "cpu":
            w = ops.dequantize(weight)
            if weight.row_group != 1:
                bound = float32_summation_bound(x, w) + held_rounding_bound(x, w)
            else:
                rounding = int8_pair_rounding_bound if SHAPES[shape] <= int8_rows() else int16_rounding_bound
                bound = float32_summation_bound(x, w) + (rounding(x, w) if shape.startswith("decode") else 0)
                bound += expanded_rounding_bound(x, w)
            assert ((got - want).abs() <= bound + 1e-6).all(), (got - want).abs().max()
        elif name == "cuda":   # fp32 IEEE dot products: summation order only
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:   # float16 activations and result; offset = min / scale rounded to float16
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    if name == "ascend" and native_backend._npu.__version__ == "simulated":
        import simulated
        assert simulated.module("ascend").calls[-1][0] == "npu_weight_quant_batchmatmul"


@pytest.mark.parametrize("layout", ["rows", "held"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cpu_one_row_path_is_the_reference_at_x_as_it_holds_it(bits, group, layout):
    """One row of x, held as two int8 codes (AVX-512 VNNI) or int16 (the AVX2 path): the integer sums are
    exact, so the result is the reference's at x so rounded up to float32 summation. The mins meet x's own
    sums (not the rounded x's), so here they are zero. ``held``: rows interleaved as the backend holds them."""
    from lmport.backends.cpu import CpuBackend, kernels
    weight = random_weight(bits, group, n=99, k=288 if group == 32 else 256, seed=4)
    weight.mins.zero_()
    if layout == "held":
        weight = CpuBackend().hold_quantized(weight, torch.float32)
        assert weight.row_group == 16
    x = torch.randn(1, weight.in_features, generator=torch.Generator().manual_seed(5))
    got = kernels.load().quant_linear(x, weight.qweight, weight.scales, weight.mins, bits, group, None,
                                      weight.row_group)
    w = ops.dequantize(weight)
    want = (rounded_as_held(x).double() @ w.double().T).float()
    assert ((got - want).abs() <= float32_summation_bound(x, w) + 1e-6).all(), (got - want).abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_int8_rows_are_each_rows_own_result(bits):
    """A few rows of x through the int8 path: each row's result is the one it has alone, bit for bit (a
    speculative verification step's rows are then those of the plain decode steps)."""
    rows = int8_rows()
    if rows < 2:
        pytest.skip("this build runs no few-row int8 path (no AVX-512 VNNI)")
    from lmport.backends.cpu import kernels
    weight = random_weight(bits, 32, n=99, k=288, seed=6)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(7))
    def call(rows_of_x: torch.Tensor) -> torch.Tensor:
        return kernels.load().quant_linear(rows_of_x, weight.qweight, weight.scales, weight.mins, bits, 32, None)

    together, alone = call(x), torch.cat([call(x[m:m + 1]) for m in range(rows)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_kernel_takes_no_rows(bits):
    """No row of x (an expert no token was routed to): an empty result, on every path."""
    from lmport.backends.cpu import kernels
    weight = random_weight(bits, 32, n=99, k=288, seed=6)
    got = kernels.load().quant_linear(torch.empty(0, weight.in_features), weight.qweight, weight.scales,
                                      weight.mins, bits, 32, None)
    assert got.shape == (0, 99)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_kernel_without_mins_is_the_kernel_with_zero_mins(bits):
    """A weight whose mins are all zero (GGUF's Q8_0) goes to the kernel without them (``zero_mins``): on every
    path (int8 rows, tiles expanded in cache) the result is the one with the zeros passed, bit for bit, and
    through the backend the reference's."""
    import dataclasses
    from lmport.backends.cpu import CpuBackend, kernels
    weight = random_weight(bits, 32, n=99, k=288, seed=8)
    weight.mins.zero_()
    compiled, backend = kernels.load(), CpuBackend()
    for rows in (1, 5, 9, 40):
        x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
        without = compiled.quant_linear(x, weight.qweight, weight.scales, None, bits, 32, None)
        zeros = compiled.quant_linear(x, weight.qweight, weight.scales, weight.mins, bits, 32, None)
        assert torch.equal(without, zeros)
        got = backend.quant_linear(x, dataclasses.replace(weight, zero_mins=True))
        w = ops.dequantize(weight)
        bound = float32_summation_bound(x, w) + int8_pair_rounding_bound(x, w) + int16_rounding_bound(x, w)
        assert ((got - ops.quant_linear(x, weight)).abs() <= bound + 1e-6).all()


def test_cpu_dequantize_kernel_is_the_reference():
    from lmport.backends.cpu import CpuBackend, kernels
    compiled = kernels.load()
    assert compiled is not None, "the cpu kernels must build here"
    for bits in (4, 8):
        w = random_weight(bits, 64, n=99)
        for held in (w, CpuBackend().hold_quantized(copied(w), torch.float32)):   # rows in order, and as held
            got = compiled.quant_dequantize(held.qweight, held.scales, held.mins, bits, 64, held.row_group)
            torch.testing.assert_close(got, ops.dequantize(w), atol=1e-6, rtol=1e-6)
            assert torch.equal(ops.dequantize(held), ops.dequantize(w))


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_held_rows_are_each_rows_own_result_for_every_step(bits):
    """Rows interleaved as the backend holds them: each row of x's result is its own for every step
    (assert_each_rows_own_result), a prefill's too (259 rows: more than one of the kernel's chunks of rows)."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, CpuBackend, kernels
    weight = CpuBackend().hold_quantized(random_weight(bits, 32, n=99, k=288, seed=6), torch.float32)
    if weight.row_group == 1:
        pytest.skip("this build holds the rows in order (no interleaved kernels)")
    x = torch.randn(2 * SMALL_BATCH_TOKENS + 3, weight.in_features, generator=torch.Generator().manual_seed(7))

    def call(rows_of_x: torch.Tensor) -> torch.Tensor:
        return kernels.load().quant_linear(rows_of_x, weight.qweight, weight.scales, weight.mins, bits, 32, None, 16)

    assert_each_rows_own_result(call, x)


def test_cpu_prefill_takes_amx_tiles_by_default_and_bf16_gemms_when_asked(monkeypatch):
    """By default a prefill (more rows than the backend's decode step) over interleaved rows takes the AMX tiles
    where the CPU has them, and the GEMMs over float32 weights stay float32; 'exact' takes no bfloat16 products,
    'bf16' the GEMMs' too; a precision the kernels do not know is refused by name."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, kernels
    monkeypatch.setenv("LMPORT_CPU_PREFILL", "fast")
    with pytest.raises(ValueError, match="LMPORT_CPU_PREFILL='fast'"):
        kernels.prefill_precision()
    monkeypatch.delenv("LMPORT_CPU_PREFILL")
    assert kernels.prefill_precision() == "auto"
    module = kernels.load()
    try:
        kernels.configured(module, "auto")
        default_rows = bf16_rows()
        can_take_tiles = module.set_bf16_prefill(True)
        assert default_rows == (SMALL_BATCH_TOKENS + 1 if can_take_tiles else 0) and not kernels.bf16_gemm()
        with cpu_prefill("exact"):
            assert bf16_rows() == 0 and not kernels.bf16_gemm()
        assert bf16_rows() == default_rows and not kernels.bf16_gemm()   # back to the default
        with bf16_prefill():
            assert bf16_rows() == SMALL_BATCH_TOKENS + 1
            assert kernels.bf16_gemm()
        assert bf16_rows() == default_rows and not kernels.bf16_gemm()
    finally:
        monkeypatch.undo()
        kernels.configured(module, kernels.prefill_precision())


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_bf16_prefill_is_the_reference_within_bfloat16_rounding(bits):
    """A prefill over interleaved rows on AMX tiles: within float32 summation and bfloat16 rounding of x and the
    weights of the reference, with and without bias, each row's result its own (assert_each_rows_own_result)."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, CpuBackend, kernels
    weight = CpuBackend().hold_quantized(random_weight(bits, 32, n=99, k=288, seed=10), torch.float32)
    g = torch.Generator().manual_seed(11)
    x, bias = torch.randn(2 * SMALL_BATCH_TOKENS + 3, weight.in_features, generator=g), torch.randn(99, generator=g)
    w = ops.dequantize(weight)

    def call(rows_of_x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.load().quant_linear(rows_of_x, weight.qweight, weight.scales, weight.mins, bits, 32, b, 16)

    assert_bf16_prefill_is_the_reference(call, lambda b: ops.quant_linear(x, weight, b), x, bias, w)


def test_cpu_kernel_refuses_rows_interleaved_otherwise():
    from lmport.backends.cpu import kernels
    w = random_weight(4, 32, k=288)
    with pytest.raises(RuntimeError, match="quant: rows interleaved in groups of 8"):
        kernels.load().quant_linear(torch.randn(1, 288), w.qweight, w.scales, w.mins, 4, 32, None, 8)


def test_cpu_kernel_refuses_a_group_size_it_does_not_take():
    """A group of 96 inputs (a multiple of 32, not 32 times a power of two) is named in the error."""
    from lmport.backends.cpu import kernels
    w = random_weight(4, 96, k=288)
    with pytest.raises(RuntimeError, match="group size 96 must be 32 times a power of two"):
        kernels.load().quant_linear(torch.randn(1, 288), w.qweight, w.scales, w.mins, 4, 96, None)


def test_backend_without_weight_formats_refuses_a_quantized_checkpoint(backend_name, capabilities, monkeypatch):
    if capabilities.weight_formats:
        pytest.skip(f"{backend_name} runs int4/int8 weights")
    from lmport.worker import runner
    from lmport.engine.engine import Engine

    def no_load(*args, **kwargs):
        raise AssertionError("refused only after loading weights")
    monkeypatch.setattr(runner, "load_model", no_load)
    with pytest.raises(ConfigError) as err:
        Engine("smollm2", EngineConfig(device_type=backend_name))
    message = str(err.value)
    assert repr(backend_name) in message and "cpu" in message and "weight_format='dequantize'" in message


def test_cpu_kernel_refuses_mins_of_another_shape_and_a_quant_linear_without_scales():
    """Mins may be left out (all zero), but mins given must match the scales; a bound quant linear needs scales."""
    from lmport.backends.cpu import kernels
    compiled = kernels.load()
    w = random_weight(4, 32, k=288)
    with pytest.raises(RuntimeError, match=r"scales and mins must be float16 \[96, 9\]"):
        compiled.quant_linear(torch.randn(1, 288), w.qweight, w.scales, w.mins[:, :8], 4, 32, None)
    with pytest.raises(RuntimeError, match="scales and mins must be float16"):
        compiled.quant_linear(torch.randn(1, 288), w.qweight, w.scales, w.mins.float(), 4, 32, None)
    with pytest.raises(RuntimeError, match="a quant linear needs scales"):
        compiled.BoundLinear("quant", w.qweight, mins=w.mins, bits=4, group_size=32)
