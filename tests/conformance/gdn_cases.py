"""The gated delta rule's test inputs, cases and error bounds, shared by every backend's kernel tests
(test_cuda_gated_delta_net.py, test_cpu_gated_delta_net.py).

Bounds, derived from the dtypes: a kernel and the reference both compute in float32 from the same inputs, in a
different order, and round the output to v's dtype. So each output differs by at most one unit in the last place
of its dtype (rtol = the dtype's eps) plus the float32 difference, bounded by one float32 eps per product summed
along the way (T tokens x (Dk + Dv) terms) times the largest value; the float32 state by the latter alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, with_state: bool,
            device, seed: int = 0):
    """q, k, v split from one [B, T, channels] tensor (the conv's output, as the model splits it), log decays g
    (float32, <= 0, as the model computes them), beta in ``dtype``, and a float32 state or None."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(b, t, 2 * hk * dk + hv * dv, generator=gen).to(dtype).to(device)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    g = (-F.softplus(torch.randn(b, t, hv, generator=gen))).to(device)
    beta = torch.sigmoid(torch.randn(b, t, hv, generator=gen)).to(dtype).to(device)
    state = torch.randn(b, hv, dk, dv, generator=gen).to(device) if with_state else None
    return q, k, v, g, beta, state


def assert_within(got_out, got_state, want_out, want_state, tokens: int, dk: int, dv: int):
    assert got_out.shape == want_out.shape and got_out.dtype == want_out.dtype
    assert got_state.shape == want_state.shape and got_state.dtype == torch.float32
    terms = max(tokens, 1) * (dk + dv)
    eps32 = torch.finfo(torch.float32).eps
    out_atol = terms * eps32 * float(want_out.abs().max())
    torch.testing.assert_close(got_out.float().cpu(), want_out.float().cpu(), atol=out_atol,
                               rtol=torch.finfo(want_out.dtype).eps)
    torch.testing.assert_close(got_state.cpu(), want_state.cpu(), atol=terms * eps32 * float(want_state.abs().max()),
                               rtol=0)


CASES = {
    # (B, T, key heads, value heads, Dk, Dv, state)
    "decode": (3, 1, 2, 4, 16, 8, True),
    "prefill": (2, 19, 2, 4, 16, 8, False),
    "prefill-over-state": (1, 23, 1, 2, 8, 16, True),
    "odd-dims": (2, 6, 1, 3, 12, 20, True),
}
