"""lmport.ops.gated_delta_net against transformers' own Qwen3-Next functions (float32, same inputs): the chunked
and the recurrent gated delta rule and the causal conv1d; a prefill split in two carrying its state gives one
whole prefill, and decode steps continue a prefill as transformers' recurrent rule continues it."""
from __future__ import annotations

import pytest
import torch

from lmport.ops import gated_delta_net as gdn

tq = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

HK, HV, DK, DV, C, K = 2, 4, 16, 8, 24, 4


def inputs(t: int, b: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)
    q, k, v = rand(b, t, HK, DK), rand(b, t, HK, DK), rand(b, t, HV, DV)
    g = -torch.nn.functional.softplus(rand(b, t, HV))      # log decays, <= 0
    beta = torch.sigmoid(rand(b, t, HV))
    return q, k, v, g, beta


def reference(fn, q, k, v, g, beta, state=None, **kw):
    return fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
              **kw)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_chunked_rule_matches_transformers(t):
    q, k, v, g, beta = inputs(t, b=2)
    state = torch.randn(2, HV, DK, DV)
    for start in (None, state):
        out, s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, start)
        ref_out, ref_s = reference(tq.torch_chunk_gated_delta_rule, q, k, v, g, beta, start)
        close(out, ref_out)
        close(s, ref_s)


@pytest.mark.parametrize("t", [1, 7])
def test_recurrent_rule_matches_transformers(t):
    q, k, v, g, beta = inputs(t, b=3, seed=1)
    state = torch.randn(3, HV, DK, DV)
    out, s = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    ref_out, ref_s = reference(tq.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    close(out, ref_out)
    close(s, ref_s)


def test_prefill_in_two_chunks_carries_the_state():
    q, k, v, g, beta = inputs(130, seed=2)
    whole, whole_s = reference(tq.torch_chunk_gated_delta_rule, q, k, v, g, beta)
    cut = 37   # not a multiple of the chunk size: the second part's chunks start elsewhere
    a, s = gdn.chunk_gated_delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut])
    b, s = gdn.chunk_gated_delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s)
    close(torch.cat([a, b], 1), whole)
    close(s, whole_s)


def test_decode_steps_continue_a_prefill():
    q, k, v, g, beta = inputs(40, seed=3)
    prompt = 33
    _, s = gdn.chunk_gated_delta_rule(q[:, :prompt], k[:, :prompt], v[:, :prompt], g[:, :prompt], beta[:, :prompt])
    _, ref_s = reference(tq.torch_chunk_gated_delta_rule, q[:, :prompt], k[:, :prompt], v[:, :prompt],
                         g[:, :prompt], beta[:, :prompt])
    for i in range(prompt, 40):
        step = (x[:, i:i + 1] for x in (q, k, v, g, beta))
        out, s = gdn.recurrent_gated_delta_rule(*step, state=s)
        ref_out, ref_s = reference(tq.torch_recurrent_gated_delta_rule, *(x[:, i:i + 1] for x in (q, k, v, g, beta)),
                                   ref_s)
        close(out, ref_out)
        close(s, ref_s)


def transformers_conv_with_cache(x_chunks, weight):
    """transformers' conv path over successive chunks of one sequence: the first through causal_conv1d_fn, the
    later ones with the carried window (multi-token: concatenated, as its cache does; one token: the update)."""
    outs, window = [], None
    for x in x_chunks:
        xt = x.t()[None]   # [1, C, T]
        if window is None:
            out = tq.causal_conv1d_fn(xt, weight, None, activation="silu")
            full = torch.nn.functional.pad(xt, (max(0, K - 1 - xt.shape[-1]), 0))
        elif xt.shape[-1] == 1:
            state = window[None].clone()
            out = tq.causal_conv1d_update(xt, state, weight, None, "silu")
            full = torch.cat([window[None], xt], -1)
        else:
            full = torch.cat([window[None], xt], -1)
            out = tq.causal_conv1d_fn(full, weight, None, activation="silu")[:, :, -xt.shape[-1]:]
        window = full[0, :, -(K - 1):]
        outs.append(out[0].t())
    return torch.cat(outs), window


def test_conv1d_carries_its_window():
    torch.manual_seed(4)
    weight = torch.randn(C, K)
    x = torch.randn(20, C)
    parts = [x[:2], x[2:11], x[11:12], x[12:13], x[13:]]   # a prompt shorter than the window, chunks, steps
    ref, ref_window = transformers_conv_with_cache(parts, weight)
    outs, window = [], None
    for p in parts:
        if window is not None and p.shape[0] == 1:
            out, windows = gdn.causal_conv1d_step(p, weight, window[None])
            out, window = out, windows[0]
        else:
            out, window = gdn.causal_conv1d(p, weight, window)
        outs.append(out)
    close(torch.cat(outs), ref)
    close(window, ref_window)
    whole, whole_window = gdn.causal_conv1d(x, weight, None)
    close(whole, ref)
    close(whole_window, ref_window)


def test_conv1d_refuses_a_channel_mismatch():
    with pytest.raises(ValueError, match="channels"):
        gdn.causal_conv1d(torch.zeros(3, C + 1), torch.zeros(C, K), None)
