"""The cuda backend's multi-head latent attention (lmport/backends/cuda/mla.py) against the reference ops
(lmport.ops.mla), and a tiny DeepSeek-V3 greedy-decoding on it.

Without a GPU the kernels run under the Triton interpreter on CPU tensors; with one, natively. Sequences: lengths
1 and exactly one block, a chunk over history, a short prompt; decode alone (split-K over the keys) and prefill (a
decode row over history mixed in); block sizes 16 and 64 with shuffled block tables; latent widths that are not
powers of two (32 + 8, and DeepSeek-V3's 512 + 64 in a slow case); quant_policy 0, 8, 4 and fp8 with the step's own
latents read as computed.

Tolerances: the fill is bit-identical to the reference under the interpreter (on a GPU: levels within one, params
exact, as test_cuda_kernels allows). Attention (``latent_attention``, the projections absorbed in both): the same
arithmetic in another order, so the results differ by rounding only: float32 within 2e-5 (absolute and relative),
bfloat16 within 4e-2 (a few units in its last place at outputs up to a few).
"""
from __future__ import annotations


import pytest
import torch

from harness import own_result
from lmport import ops
from lmport.kv.layout import CacheKind, KVLayout, LayerCache

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
POLICIES = [0, 8, 4, "fp8"]


@pytest.fixture(scope="module")
def cuda(backends):
    return backends("cuda")


def _sequences(block_size: int, decode: bool) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens): decode over lengths 1, exactly one block, more, odd; prefill of a whole block, a chunk over
    history and a prompt, beside a decode row over history."""
    if decode:
        return [1] * 4, [1, block_size, block_size + 21, 37]
    return [1, block_size, 20, 37], [9, block_size, block_size + 21, 37]


def _setup(device, policy, block_size, dtype, q_lens, kv_lens, heads=4, rank=32, rope=8, seed=0):
    """A latent cache whose shuffled blocks (block 0 unused) hold every sequence's latents, history and step, written
    by the reference fill; the step's metadata, its latents and q (q_lat: q_nope W_k, and q_rope)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in kv_lens]
    ids = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(ids[at:at + n])
        at += n
    width = rank + rope
    layout = KVLayout(1, 1, width, block_size, dtype, policy, layer_kinds=(CacheKind("latent", 1, width),))
    cache = layout.allocate(sum(blocks) + 1, device)[0]
    everything = ops.build_attention_metadata(kv_lens, kv_lens, tables, block_size, device)
    latents = torch.randn(sum(kv_lens), width, generator=gen).to(dtype).to(device)
    ops.fill_latent_cache(latents, cache, everything.slot_mapping)
    meta = ops.build_attention_metadata(q_lens, kv_lens, tables, block_size, device)
    # The step's latents: each sequence's last q_len.
    starts = [sum(kv_lens[:i]) for i in range(len(kv_lens))]
    step = torch.cat([latents[s + k - q:s + k] for s, k, q in zip(starts, kv_lens, q_lens)])
    t = sum(q_lens)
    q_lat = torch.randn(t, heads, rank, generator=gen).to(dtype).to(device)
    q_rope = torch.randn(t, heads, rope, generator=gen).to(dtype).to(device)
    return cache, meta, step, q_lat, q_rope


def _clone(cache: LayerCache) -> LayerCache:
    return LayerCache(cache.k.clone(), None, None if cache.k_qparams is None else cache.k_qparams.clone(), None,
                      cache.quant_policy, cache.block_size, kind="latent", k_scale=cache.k_scale)


def _check_mla(backend, cache, meta, step, q_lat, q_rope, new_latent: bool):
    scale = (q_lat.shape[-1] + q_rope.shape[-1]) ** -0.5
    own = step if new_latent else None
    got = own_result(backend, "latent_attention", q_lat, q_rope, cache, meta, scale, own)
    assert got is not None, "the cuda backend ran the reference op"
    want = ops.latent_attention(q_lat, q_rope, cache, meta, scale, own)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL[q_lat.dtype])


# -- fill -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", POLICIES)
def test_fill_latent_cache_equals_the_reference(cuda, policy, dtype):
    backend, mode = cuda
    q_lens, kv_lens = _sequences(16, decode=False)
    want, meta, _, *_ = _setup(backend.device, policy, 16, dtype, q_lens, kv_lens)
    got = _clone(want)
    gen = torch.Generator().manual_seed(1)
    # New values over the step's slots: a constant row (the zero-limit case), a wide and a tiny range, in a
    # non-contiguous view (as split from kv_a_proj's output).
    fresh = torch.randn(meta.num_tokens, 2, 40, generator=gen)
    fresh[0] = 3.0
    fresh[1] *= 1e2
    fresh[2] *= 1e-3
    latent = fresh.to(dtype).to(backend.device)[:, 0]
    ops.fill_latent_cache(latent, want, meta.slot_mapping)
    assert own_result(backend, "fill_latent_cache", latent, got, meta.slot_mapping) is None   # returns nothing
    exact = mode == "interpreter" or policy in (0, "fp8")
    if exact:
        assert torch.equal(got.k.view(torch.uint8), want.k.view(torch.uint8))
    else:
        unpack = (lambda x: torch.stack([x & 0xF, x >> 4], -1).flatten(-2).int()) if policy == 4 else torch.Tensor.int
        assert (unpack(got.k) - unpack(want.k)).abs().max() <= 1
    if want.k_qparams is not None:
        assert torch.equal(got.k_qparams, want.k_qparams)


def test_fill_latent_cache_skips_negative_slots(cuda):
    """A padded row (slot -1, as in a CUDA-graph batch) writes nothing."""
    backend, _ = cuda
    layout = KVLayout(1, 1, 40, 16, torch.float32, 8, layer_kinds=(CacheKind("latent", 1, 40),))
    cache = layout.allocate(2, backend.device)[0]
    backend.fill_latent_cache(torch.randn(3, 40, device=backend.device), cache,
                              torch.tensor([-1, 5, -1], device=backend.device))
    written = (cache.k != 0).flatten(2).any(-1).nonzero().tolist()
    assert written == [[0, 5]] and (cache.k_qparams[0, 5] != 0).all() and (cache.k_qparams[1] == 0).all()


# -- attention --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_latent_attention_equals_the_reference(cuda, decode, block_size, dtype):
    backend, _ = cuda
    q_lens, kv_lens = _sequences(block_size, decode)
    cache, meta, step, q_lat, q_rope = _setup(backend.device, 0, block_size, dtype, q_lens, kv_lens)
    assert meta.is_decode == decode
    _check_mla(backend, cache, meta, step, q_lat, q_rope, new_latent=True)


@pytest.mark.parametrize("policy", [8, 4, "fp8"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_latent_attention_over_a_quantized_cache(cuda, decode, policy):
    """The history read from its codes, the step's own latents as computed (and, without them, from the codes)."""
    backend, _ = cuda
    q_lens, kv_lens = _sequences(16, decode)
    cache, meta, step, q_lat, q_rope = _setup(backend.device, policy, 16, torch.float32, q_lens, kv_lens)
    _check_mla(backend, cache, meta, step, q_lat, q_rope, new_latent=True)
    _check_mla(backend, cache, meta, step, q_lat, q_rope, new_latent=False)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_split_counts(cuda, num_splits):
    """Any split count of the keys merges to the same result, empty splits (short sequences) included."""
    backend, _ = cuda
    from lmport.backends.cuda import mla
    cache, meta, step, q_lat, q_rope = _setup(backend.device, 0, 16, torch.float32, [1] * 3, [1, 150, 64])
    got = mla.latent_attention(q_lat, q_rope, cache, meta, 0.2, num_splits=num_splits)
    torch.testing.assert_close(got, ops.latent_attention(q_lat, q_rope, cache, meta, 0.2), **TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_deepseek_v3_widths(cuda, decode):
    """DeepSeek-V3's latent (512 + 64), 16 heads, bfloat16."""
    backend, _ = cuda
    q_lens, kv_lens = ([1, 1], [1, 70]) if decode else ([1, 24], [1, 70])
    cache, meta, step, q_lat, q_rope = _setup(backend.device, 0, 64, torch.bfloat16, q_lens, kv_lens,
                                                     heads=16, rank=512, rope=64)
    _check_mla(backend, cache, meta, step, q_lat, q_rope, new_latent=True)


def test_window_and_sinks_are_refused(cuda):
    backend, _ = cuda
    cache, meta, step, q_lat, q_rope = _setup(backend.device, 0, 16, torch.float32, [1], [5])
    with pytest.raises(ValueError, match="full causal attention"):
        backend.latent_attention(q_lat, q_rope, cache, meta.for_layer(4), 0.2)


def test_a_cache_of_another_width_is_refused(cuda):
    backend, _ = cuda
    cache, meta, step, q_lat, q_rope = _setup(backend.device, 0, 16, torch.float32, [1], [5])
    with pytest.raises(ValueError, match="holds 40 values a token .* not the query's latent rank 24 \\+ the rotary 8"):
        backend.latent_attention(q_lat[..., :24], q_rope, cache, meta, 0.2)


# -- the model --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["q-lora", "q-proj"])
def test_mla_layer_on_cuda_equals_transformers_in_chunks_then_decode(cuda, arch):
    """The tiny DeepSeek-V3's attention layer (tests/test_deepseek_v3.py: lmport's MLA module holding the weights of
    a transformers DeepseekV3Attention) with the cuda backend's latent ops: one sequence of 23 tokens prefilled in
    chunks of 9 and 7 (the second over history), then 7 decode steps, its blocks scattered in the cache; every
    position's output is transformers' over the whole sequence, float32, within 1e-4."""
    from test_deepseek_v3 import _attention_pair

    backend, mode = cuda
    cfg, hf, ours, rotary = _attention_pair(arch)
    ours = ours.to(backend.device)
    ours.backend = backend   # the layer's cache fill and attention: the cuda backend's ops
    n, block_size = 23, 16
    x = torch.randn(1, n, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cos, sin = rotary(x, torch.arange(n)[None])
        want = hf(x, (cos, sin), torch.full((n, n), float("-inf")).triu(1)[None, None])[0][0]
    x, cos, sin = x.to(backend.device), cos[0].to(backend.device), sin[0].to(backend.device)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layout = KVLayout(1, 1, width, block_size, torch.float32, layer_kinds=(CacheKind("latent", 1, width),))
    cache = layout.allocate(4, backend.device)[0]
    table = [3, 1]   # out of order: a gather that ignored the table would differ
    got, done = [], 0
    with torch.no_grad():
        for step in (9, 7, 1, 1, 1, 1, 1, 1, 1):
            meta = ops.build_attention_metadata([step], [done + step], [table], block_size, backend.device)
            rows = slice(done, done + step)
            got.append(ours.forward(x[0, rows], cos[rows], sin[rows], cache, meta))
            done += step
    torch.testing.assert_close(torch.cat(got).cpu(), want, atol=1e-4, rtol=1e-4, msg=lambda m: f"mode={mode}: {m}")


@pytest.mark.slow
def test_tiny_deepseek_v3_greedy_equals_the_reference_ops(cuda):
    """Greedy tokens of the tiny q-lora DeepSeek-V3 (tests/test_deepseek_v3.py) on the cuda backend equal the cpu
    backend's on the reference ops (test_engine_backends.ReferenceBackend), float32, blocks of 16, prompts of 1, 5
    and 33 tokens prefilled in chunks of 16 (crossing block boundaries) beside the others' decodes, 4 new tokens.
    Slow: the whole model (its experts too) runs under the interpreter."""
    import lmport
    from lmport import EngineConfig, GenerationConfig
    from lmport.platform.resolution import resolve_config
    from test_deepseek_v3 import prompts, tiny_model_dir
    from test_engine_backends import ReferenceBackend

    backend, mode = cuda
    chosen = [p for p in prompts() if len(p) in (1, 5, 33)]

    def greedy(device_type, backend):
        config = EngineConfig(device_type=device_type, dtype="float32", block_size=16, max_prefill_token_num=16,
                              cache_max_entry_count=32)
        with lmport.pipeline(tiny_model_dir("q-lora"), backend_config=resolve_config(config),
                             backend=backend) as pipe:
            out = pipe.generate(chosen, GenerationConfig(max_new_tokens=4, ignore_eos=True))
            assert pipe.engine.usage()["blocks_used"] == 0
        return [r.token_ids for r in out]

    assert greedy("cuda", backend) == greedy("cpu", ReferenceBackend()), f"mode={mode}"
