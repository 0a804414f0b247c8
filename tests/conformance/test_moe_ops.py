"""Every backend's fused_moe against the reference (lmport.ops.fused_moe), and the reference against a
token-by-token computation of the routed experts.

Cases: one token (decode), a few tokens (the cpu backend's gathered path) and 40 tokens (its per-expert
path; the cuda grouped GEMM with several tiles an expert), 8 experts, top 2, with an expert no token
picks. cuda runs its Triton kernel under the interpreter here; ascend and camb keep the reference
(their simulated SDKs have no MoE op).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness import op_backend  # noqa: E402
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


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_backend_matches_reference(backend_name, tokens, record_property):
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    x, gate_up, down, logits = (t.to(backend.device) for t in _case(tokens, seed=tokens))
    weights, ids = ops.route(logits, TOP_K, True)
    out = backend.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, ops.fused_moe(x, gate_up, down, weights, ids), atol=2e-5, rtol=2e-5)
