"""Every backend's fused_moe, clamped_swiglu_moe (gpt-oss) and input_scaled_moe (Llama 4) against the reference
(lmport.ops.moe), and the reference against a token-by-token computation of the routed experts.

Cases: one token (decode), a few tokens and 8 (16 token-expert pairs: the most the cpu backend's gathered
path takes) and 40 tokens (the cuda grouped GEMM with several tiles an expert), 8 experts, top 2, with an
expert no token picks. cuda runs its Triton kernel under the interpreter here. A backend that hands a case to
the reference op (ascend, camb and example always, their SDKs having no MoE op; cpu beyond its gathered path)
has nothing of its own to compare there: the case is skipped as not applicable.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness import op_backend, own_result  # noqa: E402
from lmport import ops  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 48


def _case(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 8
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 8
    logits = torch.randn(tokens, EXPERTS, generator=g)
    logits[:, 3] = -1e9          # expert 3 gets no token
    return x, gate_up, down, logits


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_reference_matches_token_by_token(tokens, renormalize):
    x, gate_up, down, logits = _case(tokens)
    weights, ids = ops.route(logits, TOP_K, renormalize)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens)) == renormalize
    want = torch.zeros(tokens, HIDDEN)
    for t in range(tokens):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            want[t] += w * F.linear(F.silu(gate) * up, down[e])
    torch.testing.assert_close(ops.fused_moe(x, gate_up, down, weights, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 8, 40])
def test_backend_matches_reference(backend_name, tokens, record_property):
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    x, gate_up, down, logits = (t.to(backend.device) for t in _case(tokens, seed=tokens))
    weights, ids = ops.route(logits, TOP_K, True)
    out = own_result(backend, "fused_moe", x, gate_up, down, weights, ids)
    if out is None:
        pytest.skip(f"n/a: {backend_name} runs the reference op for {tokens * TOP_K} token-expert pairs (comparing "
                    f"it with itself tests nothing)")
    torch.testing.assert_close(out, ops.fused_moe(x, gate_up, down, weights, ids), atol=2e-5, rtol=2e-5)


def _transformers_layout_case(tokens: int, seed: int):
    """gpt-oss's and Llama 4's experts as transformers holds them: gate_up [experts, hidden, 2 * inter], down
    [experts, inter, hidden], with biases."""
    x, gate_up, down, logits = _case(tokens, seed)
    g = torch.Generator().manual_seed(seed + 100)
    return (x, gate_up.transpose(1, 2).contiguous(), torch.randn(EXPERTS, 2 * INTER, generator=g) / 4,
            down.transpose(1, 2).contiguous(), torch.randn(EXPERTS, HIDDEN, generator=g) / 4, logits)


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("form", ["clamped_swiglu_moe", "input_scaled_moe"])
def test_backend_matches_reference_on_the_other_expert_forms(backend_name, form, tokens, record_property):
    """gpt-oss's experts (clamped SwiGLU, interleaved gate and up, biases; its top-k softmax routing) and Llama 4's
    (each expert's input scaled by its routing weight; its top-k sigmoid routing)."""
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    x, gate_up, gate_up_bias, down, down_bias, logits = (t.to(backend.device)
                                                          for t in _transformers_layout_case(tokens, tokens))
    if form == "clamped_swiglu_moe":
        args = (x, gate_up, gate_up_bias, down, down_bias, *ops.route_top_k_softmax(logits, TOP_K), 1.702, 7.0)
    else:
        args = (x, gate_up, down, *ops.route_top_k_sigmoid(logits, TOP_K))
    out = own_result(backend, form, *args)
    if out is None:
        pytest.skip(f"n/a: {backend_name} runs the reference op for {form}")
    torch.testing.assert_close(out, getattr(ops, form)(*args), atol=2e-5, rtol=2e-5)


def test_cpu_runs_its_own_kernel_up_to_its_bound():
    """cpu's cells above are skipped only beyond MOE_GATHER_PAIRS: up to it, its gathered kernel is what runs."""
    from lmport.backends.cpu import MOE_GATHER_PAIRS, CpuBackend
    largest = MOE_GATHER_PAIRS // TOP_K
    for tokens in (1, largest, largest + 1):
        x, gate_up, down, logits = _case(tokens)
        own = own_result(CpuBackend(), "fused_moe", x, gate_up, down, *ops.route(logits, TOP_K, True))
        assert (own is None) == (tokens * TOP_K > MOE_GATHER_PAIRS), tokens


# Quantized experts (a GGUF's ffn_*_exps): gate and up Q4_K, down int8 (Q8_0's form) stacked over the experts,
# run expert by expert through the backend's ggml_linear / quant_linear (lmport.models.quantized.QuantExperts).
Q_HIDDEN, Q_INTER = 256, 96


def _quantized_experts(backend):
    from ggml_cases import random_blocks
    from lmport.models.quantized import QuantExperts
    from lmport.weights.format import from_codes
    g = torch.Generator().manual_seed(5)
    gate = random_blocks("q4_k", EXPERTS * Q_INTER, Q_HIDDEN, seed=1)
    up = random_blocks("q4_k", EXPERTS * Q_INTER, Q_HIDDEN, seed=2)
    codes = torch.randint(-128, 128, (EXPERTS * Q_HIDDEN, Q_INTER), generator=g)
    scales = torch.rand(EXPERTS * Q_HIDDEN, Q_INTER // 32, generator=g) / 1024
    down = from_codes(codes, scales, torch.zeros_like(scales), 8, 32)
    experts = QuantExperts(gate, up, down, EXPERTS, backend).to(backend.device)
    float_gate_up = torch.cat([ops.dequantize_ggml(w).reshape(EXPERTS, Q_INTER, Q_HIDDEN) for w in (gate, up)], 1)
    return experts, float_gate_up, ops.dequantize(down).reshape(EXPERTS, Q_HIDDEN, Q_INTER)


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_quantized_experts_match_the_reference_on_their_dequantized_weights(backend_name, tokens, record_property):
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    if not {"q4_k"} <= backend.capabilities.ggml_types or "int8" not in backend.capabilities.weight_formats:
        pytest.skip(f"{backend_name} does not run Q4_K blocks and int8 weights")
    if mode == "interpreter" and tokens != 1:
        pytest.skip("the Triton interpreter is slow: one shape keeps the run short")
    experts, gate_up, down = _quantized_experts(backend)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, Q_HIDDEN, generator=g)
    logits = torch.randn(tokens, EXPERTS, generator=g)
    logits[:, 3] = -1e9          # expert 3 gets no token
    weights, ids = ops.route(logits, TOP_K, True)
    got = experts.forward(x.to(backend.device), weights.to(backend.device), ids.to(backend.device)).cpu()
    want = ops.fused_moe(x, gate_up, down, weights, ids)
    # The kernels round x to int16 (cpu decode; its one-row int8 path as finely) or sum in another order:
    # within 1e-4 of the largest output.
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
