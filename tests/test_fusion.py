"""q/k/v and gate/up merged into one linear at load (lmport.models.fusion): the merged linear's output
is its parts' outputs side by side, parts of different kinds stay apart, and a model loads merged."""
from __future__ import annotations

import pytest
import torch

from lmport import ops
from lmport.backends.cpu import CpuBackend
from lmport.models.fusion import ConcatLinear, merge_linears
from lmport.models.layers import Linear
from lmport.models.quantized import QuantLinear
from lmport.weights.format import from_codes


BACKEND = CpuBackend()


def float_linear(out_features: int, bias: bool, seed: int) -> Linear:
    torch.manual_seed(seed)
    return Linear(64, out_features, bias, BACKEND)


def quant_linear(out_features: int, bits: int, group: int, seed: int, bias: bool = False) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randint(0, 16, (out_features, 64), generator=g) if bits == 4
             else torch.randint(-128, 128, (out_features, 64), generator=g))
    scales = torch.rand(out_features, 64 // group, generator=g) * 0.02 + 1e-3
    weight = from_codes(codes, scales, -scales * 8 * (bits == 4), bits, group)
    return QuantLinear(weight, torch.randn(out_features, generator=g) if bias else None, BACKEND)


@pytest.mark.parametrize("bias", [False, True])
def test_merged_float_linear_is_its_parts_side_by_side(bias):
    parts = [float_linear(n, bias, seed) for seed, n in enumerate((64, 32, 32))]
    merged = merge_linears(parts)
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), torch.cat([p(x) for p in parts], -1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_merged_quantized_linear_is_its_parts_side_by_side(bits):
    parts = [quant_linear(n, bits, 32, seed, bias=True) for seed, n in enumerate((128, 128))]
    merged = merge_linears(parts)
    assert isinstance(merged, QuantLinear) and merged.bits == bits
    assert torch.equal(ops.dequantize(merged.quantized), torch.cat([ops.dequantize(p.quantized) for p in parts]))
    x = torch.randn(3, 64)
    torch.testing.assert_close(merged(x), torch.cat([p(x) for p in parts], -1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("parts", [
    lambda: [float_linear(32, False, 0), quant_linear(32, 4, 32, 1)],        # float beside quantized
    lambda: [quant_linear(32, 4, 32, 0), quant_linear(32, 8, 32, 1)],        # int4 beside int8
    lambda: [quant_linear(32, 4, 32, 0), quant_linear(32, 4, 64, 1)],        # other group sizes
], ids=["float+int4", "int4+int8", "group32+group64"])
def test_parts_of_different_kinds_are_concatenated(parts):
    parts = parts()
    merged = merge_linears(parts)
    assert isinstance(merged, ConcatLinear)
    x = torch.randn(3, 64)
    torch.testing.assert_close(merged(x), torch.cat([p(x) for p in parts], -1), atol=0, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_neighbours_of_one_kind_are_stacked_within_a_concat(bias):
    # As a Q4_K_M file has them: q and k in one format, v in another (and k beside v in another layer).
    q, k, v = (quant_linear(n, bits, 32, seed, bias) for seed, (n, bits) in enumerate(((64, 4), (32, 4), (32, 8))))
    merged = merge_linears([q, k, v])
    assert isinstance(merged, ConcatLinear) and len(merged.parts) == 2
    assert isinstance(merged.parts[0], QuantLinear) and merged.parts[0].quantized.qweight.shape[0] == 96
    assert merged.parts[1] is v
    x = torch.randn(3, 64)
    torch.testing.assert_close(merged(x), torch.cat([p(x) for p in (q, k, v)], -1), atol=1e-6, rtol=1e-6)
    reordered = merge_linears([v, q, k])
    assert isinstance(reordered, ConcatLinear)
    assert [p.quantized.qweight.shape[0] for p in reordered.parts] == [32, 96]


@pytest.mark.parametrize("parts", [
    lambda: [float_linear(32, True, 0), float_linear(32, False, 1)],         # a bias on one part only
    lambda: [float_linear(32, False, 0), float_linear(32, False, 1).to(torch.bfloat16)],   # other dtypes
], ids=["bias+none", "float32+bfloat16"])
def test_parts_that_cannot_be_one_linear_stay_apart(parts):
    assert merge_linears(parts()) is None


def test_a_loaded_model_runs_merged_projections():
    import lmport
    from lmport.config import EngineConfig
    from support.model_helpers import tiny_model_dir
    pipe = lmport.pipeline(tiny_model_dir("qwen2"), backend_config=EngineConfig(device_type="cpu"))   # q/k/v biases
    for layer in pipe.engine.model.model.layers:
        assert layer.self_attn.qkv_proj is not None and not hasattr(layer.self_attn, "q_proj")
        assert layer.mlp.gate_up_proj is not None and not hasattr(layer.mlp, "gate_proj")
