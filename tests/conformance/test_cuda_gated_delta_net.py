"""The cuda backend's gated delta rule (lmport/backends/cuda/gated_delta_net.py) against the reference ops
(lmport.ops.gated_delta_net), and the tiny Qwen3-Next's linear-attention layer and greedy tokens on it.

Without a GPU the kernel runs under the Triton interpreter on CPU tensors; with one, natively. Cases: a decode step
(one token, a batch of sequences) and prefills of several tokens, from zeros and from a given state; GQA (value
heads a multiple of the key heads) and head dims that are not powers of two; q, k, v and beta in float32, bfloat16
and float16, read as views split from the conv's output (strided, as the model passes them); a prefill continued
by decode steps; the state columns split over programs.

The inputs, cases and bounds: gdn_cases.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

from gdn_cases import CASES, assert_within, inputs

from lmport.ops import gated_delta_net as gdn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


@pytest.fixture(scope="module")
def cuda(backends):
    return backends("cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_recurrent_reference(cuda, case, dtype):
    backend, mode = cuda
    b, t, hk, hv, dk, dv, with_state = CASES[case]
    args = inputs(b, t, hk, hv, dk, dv, dtype, with_state, backend.device)
    from lmport.backends.cuda import gated_delta_net as kernel
    got = kernel.recurrent_gated_delta_rule(*args)
    want = gdn.recurrent_gated_delta_rule(*args)
    assert torch.isfinite(got[0]).all()
    assert_within(*got, *want, t, dk, dv)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_kernel_equals_the_recurrent_reference(cuda, case, dtype):
    """The chunked kernel on the same cases: a decode step and prompts shorter than one chunk (its padded rows), and
    19 and 23 tokens (a whole chunk of 16, then a partial one)."""
    backend, _ = cuda
    b, t, hk, hv, dk, dv, with_state = CASES[case]
    args = inputs(b, t, hk, hv, dk, dv, dtype, with_state, backend.device)
    from lmport.backends.cuda import gated_delta_net as kernel
    got = kernel.chunk_gated_delta_rule(*args)
    assert torch.isfinite(got[0]).all()
    assert_within(*got, *gdn.recurrent_gated_delta_rule(*args), t, dk, dv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zeros", "state"])
def test_prefill_equals_the_chunked_reference(cuda, with_state, dtype):
    """The backend's chunk_gated_delta_rule (the model's prefill call: the chunked kernel at this length) against the
    chunked reference, over more tokens than one of the reference's chunks (64)."""
    backend, _ = cuda
    args = inputs(1, 67, 1, 2, 16, 8, dtype, with_state, backend.device, seed=1)
    got = backend.chunk_gated_delta_rule(*args)
    want = gdn.chunk_gated_delta_rule(*args)
    assert_within(*got, *want, 67, 16, 8)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_kernel_with_nearly_equal_keys(cuda, chunk_size):
    """Keys nearly alike, beta near 1 and almost no decay: the chunk's triangular system is at its worst (a power
    series for its inverse loses everything in float32 here); solved by substitution, as the reference solves it,
    it stays within the bound."""
    backend, _ = cuda
    from lmport.backends.cuda import gated_delta_net as kernel
    q, k, v, g, beta, state = inputs(1, 40, 1, 1, 16, 16, torch.float32, True, backend.device, seed=6)
    k = k[:, :1] + 0.05 * k
    beta, g = torch.full_like(beta, 0.999), torch.full_like(g, -1e-3)
    got = kernel.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert_within(*got, *gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state), 40, 16, 16)


def test_prefill_then_decode_steps_carry_the_state(cuda):
    """A prompt of 20 tokens, then 3 decode steps each from the state the last left: the outputs and final state of
    the reference over all 23 tokens at once."""
    backend, _ = cuda
    q, k, v, g, beta, state = inputs(2, 23, 2, 4, 16, 8, torch.float32, True, backend.device, seed=2)
    want_out, want_state = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    outs = []
    out, s = backend.chunk_gated_delta_rule(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], state)
    outs.append(out)
    for i in range(20, 23):
        out, s = backend.recurrent_gated_delta_rule(*(x[:, i:i + 1] for x in (q, k, v, g, beta)), s)
        outs.append(out)
    assert_within(torch.cat(outs, 1), s, want_out, want_state, 23, 16, 8)


@pytest.mark.parametrize("block_v", [4, 8, 16])
@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_state_columns_split_over_programs(cuda, form, block_v):
    """Dv = 20 in tiles of 4 (five programs a head), 8 or 16 (the last tile partly masked): what one program gives,
    to the bit token by token under the interpreter; compiled, and for the chunked kernel (tiles of 16 at least:
    tl.dot's), within the bound, as code of another tile width may contract and sum in another order."""
    backend, mode = cuda
    from lmport.backends.cuda import gated_delta_net as kernel
    run = getattr(kernel, f"{form}_gated_delta_rule")
    args = inputs(2, 18, 1, 2, 12, 20, torch.float32, True, backend.device, seed=3)
    split = run(*args, block_v=block_v)
    whole = run(*args, block_v=32)
    if form == "recurrent" and mode == "interpreter":
        torch.testing.assert_close(split, whole, atol=0, rtol=0)
    else:
        assert_within(*split, *whole, 18, 12, 20)


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 6], ids=["decode", "prefill"])
def test_qwen3_next_widths(cuda, tokens):
    """Qwen3-Next-80B's linear layers: 16 key heads, 32 value heads, Dk = Dv = 128, bfloat16, from a state; the state
    in the GPU's tiles of 32 columns (GPU_BLOCK_V) and in one."""
    backend, _ = cuda
    from lmport.backends.cuda import gated_delta_net as kernel
    args = inputs(2, tokens, 16, 32, 128, 128, torch.bfloat16, True, backend.device, seed=5)
    want = gdn.recurrent_gated_delta_rule(*args)
    for block_v in (kernel.GPU_BLOCK_V, 128):
        assert_within(*kernel.recurrent_gated_delta_rule(*args, block_v=block_v), *want, tokens, 128, 128)
        assert_within(*kernel.chunk_gated_delta_rule(*args, block_v=block_v), *want, tokens, 128, 128)


def test_the_backend_runs_the_kernel_not_the_reference(cuda, monkeypatch):
    backend, _ = cuda

    def refuse(*args, **kwargs):
        raise AssertionError("the cuda backend ran the reference op")
    monkeypatch.setattr(gdn, "recurrent_gated_delta_rule", refuse)
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", refuse)
    args = inputs(1, 3, 1, 1, 8, 8, torch.float32, False, backend.device)
    for op in (backend.recurrent_gated_delta_rule, backend.chunk_gated_delta_rule):
        out, state = op(*args)
        assert out.shape == (1, 3, 1, 8) and state.shape == (1, 1, 8, 8)


def test_prefills_from_one_chunk_on_run_the_chunked_kernel(cuda, monkeypatch):
    backend, _ = cuda
    from lmport.backends.cuda import gated_delta_net as kernel
    ran = []
    for form in ("recurrent", "chunk"):
        run = getattr(kernel, f"{form}_gated_delta_rule")
        monkeypatch.setattr(kernel, f"{form}_gated_delta_rule",
                            lambda *args, form=form, run=run, **kw: ran.append(form) or run(*args, **kw))
    for tokens in (1, kernel.CHUNK - 1, kernel.CHUNK):
        backend.chunk_gated_delta_rule(*inputs(1, tokens, 1, 1, 8, 8, torch.float32, False, backend.device)[:5])
    assert ran == ["recurrent", "recurrent", "chunk"]


def test_bad_shapes_are_refused(cuda):
    backend, _ = cuda
    q, k, v, g, beta, state = inputs(1, 2, 2, 3, 8, 8, torch.float32, True, backend.device)
    with pytest.raises(ValueError, match="3 value heads are not a multiple of 2 key heads"):
        backend.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    q, k, v, g, beta, state = inputs(1, 2, 1, 2, 8, 8, torch.float32, True, backend.device)
    with pytest.raises(ValueError, match=r"the state must be \[B, value heads, Dk, Dv\]"):
        backend.recurrent_gated_delta_rule(q, k, v, g, beta, state[..., :4])
    with pytest.raises(ValueError, match=r"beta must be \[B, T, value heads\]"):
        backend.recurrent_gated_delta_rule(q, k, v, g, beta[:, :1], state)


# -- the model ----------------------------------------------------------------------------------------------------

def test_linear_attention_layer_on_cuda_equals_the_reference_ops(cuda):
    """The tiny Qwen3-Next's first linear-attention layer (tests/support/qwen3_next_model.py) over three steps of two
    sequences in their own state slots: both prefilled (18 tokens: the chunked kernel; 5: token by token), then one
    decodes while the other prefills a chunk over its history, then both decode. Each step's output and the slots'
    states on the cuda backend are the reference backend's (lmport.ops), float32, within the bound above."""
    from lmport.kv.state_pool import StateTensors
    from lmport.models.loader import load_model
    from lmport.ops import build_attention_metadata
    from support.qwen3_next_model import tiny_model_dir
    from test_engine_backends import ReferenceBackend

    backend, _ = cuda
    reference = ReferenceBackend()
    model = load_model(tiny_model_dir(), reference, torch.float32).model
    layer = model.model.layers[0].linear_attn
    cfg = model.config
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    steps = [([18, 5], [18, 5]), ([1, 4], [19, 9]), ([1, 1], [20, 10])]
    results = {}
    for name, ops_backend in (("reference", reference), ("cuda", backend)):
        device = ops_backend.device
        on_device = copy.deepcopy(layer).to(device)
        on_device.backend = ops_backend
        states = StateTensors(model.recurrent_state(cfg, torch.float32), 3, device)
        outs, row = [], 0
        with torch.no_grad():
            for q_lens, kv_lens in steps:
                meta = build_attention_metadata(q_lens, kv_lens, [[0], [1]], 64, device)
                n = sum(q_lens)
                outs.append(on_device.forward(x[row:row + n].to(device), meta, [2, 1], states.conv[0],
                                              states.state[0]).cpu())
                row += n
        results[name] = (torch.cat(outs), states.state[0][1:].cpu(), states.conv[0][1:].cpu())
    (want, want_state, want_conv), (got, got_state, got_conv) = results["reference"], results["cuda"]
    assert torch.equal(got_conv, want_conv)   # the conv window stays on the reference op
    assert_within(got[None], got_state, want[None], want_state, 20, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim)


@pytest.mark.slow
def test_tiny_qwen3_next_greedy_on_cuda_equals_transformers(cuda):
    """Greedy tokens of the tiny Qwen3-Next on the cuda backend (every kernel: attention, experts, the delta rule)
    are transformers' (float32), prompts of 1, 20 and 45 tokens in chunks of 24 over blocks of 16, batched, with
    decode graphs left to the backend (the runner captures none for a model with recurrent state)."""
    import lmport
    from lmport import EngineConfig, GenerationConfig
    from lmport.platform.resolution import resolve_config
    from support.qwen3_next_model import tiny_model_dir
    from test_qwen3_next import prompts, reference

    backend, mode = cuda
    lengths = (1, 20, 45)
    config = EngineConfig(device_type="cuda", dtype="float32", block_size=16, max_prefill_token_num=24)
    with lmport.pipeline(tiny_model_dir(), backend_config=resolve_config(config), backend=backend) as pipe:
        assert not pipe.engine.config.eager_mode and pipe.engine.runner.graphs is None
        out = pipe.generate(prompts(lengths), GenerationConfig(max_new_tokens=6, ignore_eos=True))
        assert pipe.engine.usage()["blocks_used"] == 0
    assert [r.token_ids for r in out] == list(reference(lengths, 6)), f"mode={mode}"

