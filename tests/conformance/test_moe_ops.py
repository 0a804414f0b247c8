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


# Experts wholly in GGUF blocks (Q4_K gate and up, Q6_K down, as a Q4_K_M file holds them) in each activation a
# family uses: Qwen3-MoE's silu (weights on the outputs), Llama 4's (weights on the inputs) and gpt-oss's clamped
# SwiGLU with biases.
ACTIVATIONS = ("silu", "scale_inputs", "clamped")
ALPHA, LIMIT = 1.702, 7.0


def _gguf_experts(activation: str, device: torch.device):
    """The experts (``ops.QuantizedExperts``) and the reference op over their dequantized weights."""
    from ggml_cases import random_blocks
    gate, up = (random_blocks("q4_k", EXPERTS * Q_HIDDEN, Q_HIDDEN, seed=s) for s in (1, 2))
    down = random_blocks("q6_k", EXPERTS * Q_HIDDEN, Q_HIDDEN, seed=3)
    g, u, d = (ops.dequantize_ggml(w).reshape(EXPERTS, Q_HIDDEN, Q_HIDDEN) for w in (gate, up, down))
    biases = tuple(torch.randn(EXPERTS, Q_HIDDEN, generator=torch.Generator().manual_seed(s)) for s in (4, 5, 6))
    on_device = (ops.GGMLWeight(w.blocks.to(device), w.type_name, w.in_features) for w in (gate, up, down))
    experts = ops.QuantizedExperts(*on_device, EXPERTS,
                                   biases=tuple(b.to(device) for b in biases) if activation == "clamped" else None,
                                   clamp=(ALPHA, LIMIT) if activation == "clamped" else None,
                                   scale_inputs=activation == "scale_inputs")
    if activation == "silu":
        return experts, lambda x, w, i: ops.fused_moe(x, torch.cat([g, u], 1), d, w, i)
    if activation == "scale_inputs":
        return experts, lambda x, w, i: ops.input_scaled_moe(x, torch.cat([g, u], 1).mT, d.mT, w, i)
    gate_up = torch.stack([g.mT, u.mT], dim=-1).flatten(2)                  # gate and up columns interleaved
    gate_up_bias = torch.stack(biases[:2], dim=-1).flatten(1)
    return experts, lambda x, w, i: ops.clamped_swiglu_moe(x, gate_up, gate_up_bias, d.mT, biases[2], w, i, ALPHA,
                                                           LIMIT)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_gguf_experts_of_every_activation_match_the_reference(backend_name, activation, tokens, record_property):
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    if not {"q4_k", "q6_k"} <= backend.capabilities.ggml_types:
        pytest.skip(f"{backend_name} does not run Q4_K and Q6_K blocks")
    if mode == "interpreter" and tokens != 1:
        pytest.skip("the Triton interpreter is slow: one shape keeps the run short")
    experts, reference = _gguf_experts(activation, backend.device)
    experts = backend.hold_experts(experts, torch.float32)   # as the loader holds them
    gen = torch.Generator().manual_seed(tokens)
    x, logits = torch.randn(tokens, Q_HIDDEN, generator=gen), torch.randn(tokens, EXPERTS, generator=gen)
    logits[:, 3] = -1e9          # expert 3 gets no token
    weights, ids = ops.route(logits, TOP_K, True)
    got = backend.quantized_moe(x.to(backend.device), experts, weights.to(backend.device),
                                ids.to(backend.device)).cpu()
    want = reference(x, weights, ids)
    # As the test above: the kernels round x (int16 or two int8 codes) or sum in another order.
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("held", [False, True], ids=["file-rows", "held"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("tokens", [1, 5, 40, 130])
def test_cpu_experts_in_one_call_are_the_loop_over_its_kernels(activation, tokens, held):
    """The cpu backend runs GGUF experts in one kernel call (csrc/ggml_experts.cpp) that stands for the reference
    loop over its own linear kernels: the same kernels on the same rows, so the same outputs up to the rounding
    of the sums and of gpt-oss's sigmoid; and a wrong row, expert or routing weight would be off by whole units.
    Over the rows as the file lays them out and as ``hold_experts`` holds them (interleaved where the build reads
    them so); past SMALL_BATCH_TOKENS tokens only where the loop would run the same kernels (held rows, a build
    whose group kernels run prefills)."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, CpuBackend, kernels
    from lmport.platform.backend import Backend
    compiled = kernels.load()
    if compiled is None:
        pytest.skip("the cpu kernels are not built here")
    backend = CpuBackend()
    experts, _ = _gguf_experts(activation, backend.device)
    interleaves = {"q4_k", "q6_k"} <= set(compiled.ggml_interleaved_types())
    if held:
        experts = backend.hold_experts(experts, torch.float32)
        assert {w.row_group for w in (experts.gate, experts.up, experts.down)} == ({16} if interleaves else {1})
    gen = torch.Generator().manual_seed(tokens)
    x, logits = torch.randn(tokens, Q_HIDDEN, generator=gen), torch.randn(tokens, EXPERTS, generator=gen)
    logits[:, 3] = -1e9
    weights, ids = ops.route(logits, TOP_K, True)
    got = own_result(backend, "quantized_moe", x, experts, weights, ids)
    one_call = tokens <= SMALL_BATCH_TOKENS or (held and interleaves and compiled.interleaved_prefill())
    assert (got is not None) == one_call, "the cpu backend picked the other of its kernel call and its loop"
    if got is None:
        pytest.skip("n/a: the loop runs this case (each expert's tokens through a GEMM)")
    want = Backend.quantized_moe(backend, x, experts, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=0)


def test_cpu_experts_kernel_refuses_bad_ids_and_shapes_by_name():
    """The kernel call's own checks: an expert id outside the experts, and a stacked weight whose rows are not the
    experts' whole rows, are refused with what was expected, not read out of bounds."""
    from lmport.backends.cpu import kernels
    compiled = kernels.load()
    if compiled is None:
        pytest.skip("the cpu kernels are not built here")
    experts, _ = _gguf_experts("silu", torch.device("cpu"))
    stacks = [(w.blocks, w.type_name, w.row_group) for w in (experts.gate, experts.up, experts.down)]
    x, weights = torch.randn(1, Q_HIDDEN), torch.ones(1, TOP_K)
    with pytest.raises(RuntimeError, match=r"expert ids must be in \[0, 8\)"):
        compiled.ggml_experts(x, torch.tensor([[0, EXPERTS]]), weights, EXPERTS, *stacks[0], *stacks[1], *stacks[2])
    short_down = (stacks[2][0][:-1], *stacks[2][1:])
    with pytest.raises(RuntimeError, match="down must be 8 experts x 256 contiguous rows"):
        compiled.ggml_experts(x, torch.tensor([[0, 1]]), weights, EXPERTS, *stacks[0], *stacks[1], *short_down)
