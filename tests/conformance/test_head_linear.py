"""Every backend's head_linear (MLA's absorbed per-head projections: each head's inputs through its own rows of one
weight) against the reference on the weight dequantized, over the formats a GGUF's ``attn_k_b`` / ``attn_v_b``
come in (GGUF blocks of Q5_0, Q4_K and Q6_K, Q8_0 as int8), held as the loader holds them (``hold_heads``: on the
cpu backend interleaved in groups of 16 where each head's rows are whole groups), for a decode step (1 token), a
few tokens, and a prefill beyond the cpu kernels' decode rows (130). Shapes: DeepSeek-V3's two projections scaled
down (4 heads; k_b: 64 rows of 32 inputs a head, v_b: 32 rows of 256 inputs a head) and a head of 8 rows, which
the cpu backend cannot hold interleaved.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ggml_cases import copied, random_blocks  # noqa: E402
from harness import op_backend  # noqa: E402
from lmport import ops  # noqa: E402

HEADS = 4


def _weight(kind: str, rows: int, in_features: int):
    """(the weight as the loader hands it, the same dequantized to float32)."""
    from lmport.weights.format import from_codes
    if kind == "q8_0":
        g = torch.Generator().manual_seed(rows + in_features)
        codes = torch.randint(-128, 128, (HEADS * rows, in_features), generator=g)
        scales = torch.rand(HEADS * rows, in_features // 32, generator=g) / 1024
        weight = from_codes(codes, scales, torch.zeros_like(scales), 8, 32)
        return weight, ops.dequantize(weight)
    weight = random_blocks(kind, HEADS * rows, in_features, seed=rows)
    return weight, ops.dequantize_ggml(weight)


SHAPES = {"k_b": (64, 32), "v_b": (32, 256), "8-row heads": (8, 256)}


@pytest.mark.parametrize("tokens", [1, 5, 130])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["q5_0", "q4_k", "q6_k", "q8_0"])
def test_head_linear_matches_the_reference(backend_name, kind, shape, tokens, record_property):
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    rows, in_features = SHAPES[shape]
    if kind in ("q4_k", "q6_k") and in_features % 256:
        pytest.skip(f"{kind} blocks are 256 inputs wide")
    if kind == "q8_0" and "int8" not in backend.capabilities.weight_formats or \
            kind != "q8_0" and kind not in backend.capabilities.ggml_types:
        pytest.skip(f"{backend_name} does not run {kind} weights")
    if mode == "interpreter" and tokens != 1:
        pytest.skip("the Triton interpreter is slow: one shape keeps the run short")
    weight, dense = _weight(kind, rows, in_features)
    held = backend.hold_heads(copied(weight, backend.device), HEADS, torch.float32)
    x = torch.randn(tokens, HEADS, in_features, generator=torch.Generator().manual_seed(tokens))
    got = backend.head_linear(x.to(backend.device), held).cpu()
    want = ops.head_linear(x, dense)
    assert got.shape == (tokens, HEADS, rows)
    # The kernels round x (int16 or two int8 codes) or sum in another order: within 1e-4 of the largest output.
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def test_the_reference_is_each_head_through_its_own_rows():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, HEADS, 16, generator=g), torch.randn(HEADS * 8, 16, generator=g)
    want = torch.stack([x[:, h] @ w[h * 8:(h + 1) * 8].T for h in range(HEADS)], dim=1)
    torch.testing.assert_close(ops.head_linear(x, w), want)


def test_cpu_holds_whole_groups_a_head_and_runs_them_in_one_call():
    """The cpu backend holds a head's rows interleaved where they are whole groups of 16 (not 8-row heads), and
    runs GGUF heads in one kernel call (csrc bindings' ggml_head_linear) where its kernels take the weight."""
    from lmport.backends.cpu import CpuBackend, kernels
    compiled = kernels.load()
    if compiled is None or not compiled.ggml_interleaved_types():
        pytest.skip("no compiled kernels reading interleaved rows on this machine")
    backend = CpuBackend()
    assert backend.hold_heads(_weight("q5_0", 8, 256)[0], HEADS, torch.float32).row_group == 1
    held = backend.hold_heads(_weight("q5_0", 64, 32)[0], HEADS, torch.float32)
    assert held.row_group == 16
    calls = []
    original = compiled.ggml_head_linear
    try:
        compiled.ggml_head_linear = lambda *a, **k: calls.append(1) or original(*a, **k)
        backend.head_linear(torch.randn(1, HEADS, 32), held)
    finally:
        compiled.ggml_head_linear = original
    assert calls == [1]


def test_cpu_kernel_names_a_weight_that_does_not_split_into_the_heads():
    """The compiled per-head call refuses, by what is wrong, rows that are not the heads' equal shares and x of
    another width."""
    from lmport.backends.cpu import kernels
    compiled = kernels.load()
    if compiled is None:
        pytest.skip("no compiled kernels on this machine")
    weight = random_blocks("q5_0", 4 * 8 + 1, 32, seed=1)
    with pytest.raises(RuntimeError, match="must be 4 heads' contiguous rows"):
        compiled.ggml_head_linear(torch.randn(HEADS, 2, 32), weight.blocks, "q5_0", 32)
    weight = random_blocks("q5_0", 4 * 8, 32, seed=1)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[heads, tokens, 32\]"):
        compiled.ggml_head_linear(torch.randn(HEADS, 2, 64), weight.blocks, "q5_0", 32)
