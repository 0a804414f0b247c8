"""The cpu backend's gated delta rule token by token (Gated DeltaNet's decode: the compiled kernel, csrc/
gated_delta_net.cpp, which updates each sequence's state in its row of the state pool) against the reference op
(lmport.ops.gated_delta_net), on gdn_cases.py's cases and bounds, and at Qwen3-Next-80B's widths."""
from __future__ import annotations

import pytest
import torch
from gdn_cases import CASES, assert_within, inputs

from lmport.ops import gated_delta_net as gdn

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def cpu():
    from lmport.backends.cpu import CpuBackend, kernels
    if kernels.load() is None:
        pytest.skip("the cpu kernels did not build here")
    return CpuBackend()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_recurrent_reference(cpu, case, dtype):
    b, t, hk, hv, dk, dv, with_state = CASES[case]
    args = inputs(b, t, hk, hv, dk, dv, dtype, with_state, "cpu")
    assert_within(*cpu.recurrent_gated_delta_rule(*args), *gdn.recurrent_gated_delta_rule(*args), t, dk, dv)


def test_qwen3_next_widths(cpu):
    """16 key heads, 32 value heads, Dk = Dv = 128, a decode step of 3 sequences from their states."""
    args = inputs(3, 1, 16, 32, 128, 128, torch.float32, True, "cpu", seed=5)
    assert_within(*cpu.recurrent_gated_delta_rule(*args), *gdn.recurrent_gated_delta_rule(*args), 1, 128, 128)


def test_prefill_then_decode_steps_carry_the_state(cpu):
    """A prompt of 20 tokens on the chunked reference, then 3 decode steps on the kernel, each from the state the last
    left: the reference's outputs and final state over all 23 tokens at once."""
    q, k, v, g, beta, state = inputs(2, 23, 2, 4, 16, 8, torch.float32, True, "cpu", seed=2)
    want_out, want_state = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out, s = cpu.chunk_gated_delta_rule(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], state)
    outs = [out]
    for i in range(20, 23):
        out, s = cpu.recurrent_gated_delta_rule(*(x[:, i:i + 1] for x in (q, k, v, g, beta)), s)
        outs.append(out)
    assert_within(torch.cat(outs, 1), s, want_out, want_state, 23, 16, 8)


def test_the_backend_runs_the_kernel_and_leaves_the_state_it_was_given(cpu, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the cpu backend ran the reference op")
    monkeypatch.setattr(gdn, "recurrent_gated_delta_rule", refuse)
    q, k, v, g, beta, state = inputs(2, 1, 1, 2, 8, 8, torch.float32, True, "cpu")
    before = state.clone()
    out, after = cpu.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (2, 1, 2, 8) and after.shape == (2, 2, 8, 8)
    assert torch.equal(state, before) and not torch.equal(after, before)


def test_the_states_are_updated_in_their_rows_of_the_pool(cpu):
    """A decode step of 2 sequences whose states are rows 2 and 0 of a pool of 4 (the model's state slots): the
    reference's outputs, those rows left as the reference's states after the step, the other rows untouched."""
    q, k, v, g, beta, state = inputs(2, 1, 2, 4, 16, 8, torch.float32, True, "cpu", seed=7)
    pool = torch.randn(4, 4, 16, 8, generator=torch.Generator().manual_seed(8))
    slots = torch.tensor([2, 0])
    pool[slots] = state
    before = pool.clone()
    want_out, want_state = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out = cpu.recurrent_gated_delta_rule_in_place(q, k, v, g, beta, pool, slots)
    assert_within(out, pool[slots], want_out, want_state, 1, 16, 8)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_what_the_kernel_cannot_take_is_refused_by_name(cpu):
    from lmport.backends.cpu import kernels
    compiled = kernels.load()
    args = inputs(1, 1, 1, 1, 8, 520, torch.float32, False, "cpu")
    with pytest.raises(RuntimeError, match="value heads of up to 512"):
        compiled.recurrent_gated_delta_rule(*gdn.heads_first(*args[:5]), torch.zeros(1, 1, 8, 520), torch.tensor([0]))
    args = inputs(1, 1, 1, 1, 8, 8, torch.float32, False, "cpu")
    with pytest.raises(RuntimeError, match="row 3 of a pool of 2"):
        compiled.recurrent_gated_delta_rule(*gdn.heads_first(*args[:5]), torch.zeros(2, 1, 8, 8), torch.tensor([3]))
    args = inputs(2, 1, 1, 1, 8, 8, torch.float32, False, "cpu")
    with pytest.raises(RuntimeError, match="each sequence needs a row of its own"):
        compiled.recurrent_gated_delta_rule(*gdn.heads_first(*args[:5]), torch.zeros(2, 1, 8, 8), torch.tensor([1, 1]))
