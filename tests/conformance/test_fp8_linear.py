"""fp8 weights' linear on every backend that runs it (``Backend.fp8_linear``) against the exact product, and the
refusal of an fp8 checkpoint on backends whose capabilities declare no fp8 weight scales.

Matrix: the three scale layouts (per-tensor, per-channel, 128 x 128 blocks, the last ones here short in both
directions: 200 x 320 weights), decode and prefill row counts, float32 / bfloat16 / float16 activations, with and
without bias. The cuda cell runs the Triton kernel under the interpreter (or natively on a GPU); cpu runs the
reference op, so its cell is not applicable (docs/testing.md).

Tolerance, derived: against y64 = x @ (q * s)^T in float64 (the exact product of the very inputs), a kernel
rounds each weight q * s once to the dot's operand dtype (unit roundoff u_w: 2^-24 for float32, 2^-8 for bfloat16
and 2^-11 for float16 operands on a GPU; the interpreter widens bfloat16 to float32), sums in float32 in any order
(K * 2^-24 * sum |x w|) and rounds the result to x's dtype (u_out * |y|; the interpreter truncates its float32 ->
bfloat16 casts, up to 2 u_out * |y|): |y - y64| <= (2 u_w + K * 2^-24) * sum_k |x_k w_k| + 2 u_out * |y64|, the
first factor 2 for the reference op (the bound's other user), which rounds the weight to x's dtype and x w again.
Measured under the interpreter at 40 rows: at most 0.22 of the bound (bfloat16), 0.11 (float16), 0.01 (float32).
"""
from __future__ import annotations

import json

import pytest
import torch

from lmport.config import ConfigError, EngineConfig
from lmport.platform.backend import Backend
from lmport.weights import fp8
from harness import op_backend

LAYOUTS = {"tensor": lambda n, k: (n, k), "channel": lambda n, k: (1, k), "block": lambda n, k: (128, 128)}
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def random_fp8(layout: str, n: int = 200, k: int = 320, seed: int = 0,
               scale_dtype: torch.dtype = torch.float32) -> fp8.Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) + 0.1) * 0.05
    return fp8.quantize(w, *LAYOUTS[layout](n, k), scale_dtype=scale_dtype)


def fp8_cell(backend_name: str) -> Backend:
    backend, _mode = op_backend(backend_name)
    if type(backend).fp8_linear is Backend.fp8_linear:
        pytest.skip(f"{backend_name} runs fp8 weights on the reference op (or not at all): not applicable")
    return backend


def bound(x: torch.Tensor, w: torch.Tensor, y64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    products = x.double().abs() @ w.double().abs().T
    u_w = max(UNIT_ROUNDOFF[dtype], 2.0 ** -24)
    return (2 * u_w + x.shape[1] * 2.0 ** -24) * products + 2 * UNIT_ROUNDOFF[dtype] * y64.abs() + 1e-30


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp8_linear_matches_the_exact_product(backend_name, layout, rows, dtype):
    backend = fp8_cell(backend_name)
    # per-channel scales in bfloat16, as compressed-tensors keeps them for a bfloat16 model
    weight = random_fp8(layout, seed=rows, scale_dtype=torch.bfloat16 if layout == "channel" else torch.float32)
    g = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, weight.in_features, generator=g).to(dtype)
    bias = (torch.randn(weight.out_features, generator=g) * 0.1).to(dtype) if rows != 5 else None
    w = fp8.dequantize(weight, torch.float32)
    y64 = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    limit = bound(x, w, y64, dtype)
    dev = backend.device
    moved = fp8.Fp8Weight(weight.qweight.to(dev), weight.scale.to(dev), weight.block_out, weight.block_in)
    got = backend.fp8_linear(x.to(dev), moved, None if bias is None else bias.to(dev)).cpu()
    assert got.dtype == dtype and got.shape == (rows, weight.out_features)
    excess = ((got.double() - y64).abs() - limit).max().item()
    assert excess <= 0, f"over the bound by {excess}"
    reference = fp8.fp8_linear(x, weight, bias)
    assert ((reference.double() - y64).abs() - limit).max().item() <= 0   # the bound holds the reference too


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp8_linear_decodes_every_code_as_torch_casts_it(backend_name, scale_dtype):
    """x = the identity: each output is one weight times 1 (no sum, no rounding in float32), so the result is the
    dequantized weight itself (the reference's: a 16-bit scale's product rounded to its dtype), bit for bit, over
    all 254 finite e4m3 codes (subnormals, +-0, +-448) in each scale block of a 128 x 128 layout with short last
    blocks."""
    backend = fp8_cell(backend_name)
    n, k = 130, 254
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[(torch.arange(n)[:, None] + torch.arange(k)[None, :]) % len(finite)].view(fp8.FP8_DTYPE)
    g = torch.Generator().manual_seed(3)
    scale = (torch.rand(2, 2, generator=g) + 0.5).to(scale_dtype)
    weight = fp8.Fp8Weight(codes, scale, 128, 128).check()
    dev = backend.device
    moved = fp8.Fp8Weight(weight.qweight.to(dev), weight.scale.to(dev), 128, 128)
    got = backend.fp8_linear(torch.eye(k, device=dev), moved).cpu()
    want = (weight.qweight.float() * scale.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k])
    assert torch.equal(got.T, want.to(scale_dtype).float())   # a 16-bit scale's product rounded to its dtype
    assert torch.equal(got.T, fp8.dequantize(weight, torch.float32))


def tiny_fp8_checkpoint(tmp_path):
    """A one-layer Llama whose projections are fp8 with 128 x 128 block scales (quant_method "fp8")."""
    import transformers
    from safetensors.torch import save_file
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("_proj.weight"):
            w = fp8.quantize(t, 128, 128)
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = w.qweight, w.scale
        else:
            tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = cfg.to_dict() | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_backend_without_fp8_weights_refuses_an_fp8_checkpoint(backend_name, capabilities, monkeypatch, tmp_path):
    """Refused before any weight loads, naming the device, the backends that run fp8 weights and the option that
    dequantizes them at load."""
    if "block" in capabilities.fp8_weight_scales:
        pytest.skip(f"{backend_name} runs block-scaled fp8 weights")
    from lmport.engine.engine import Engine
    from lmport.worker import runner

    def no_load(*args, **kwargs):
        raise AssertionError("refused only after loading weights")
    monkeypatch.setattr(runner, "load_model", no_load)
    with pytest.raises(ConfigError) as err:
        Engine(str(tiny_fp8_checkpoint(tmp_path)), EngineConfig(device_type=backend_name))
    message = str(err.value)
    assert repr(backend_name) in message and "block" in message and "weight_format='dequantize'" in message
    assert "cuda" in message   # the in-tree backend that runs them
