"""The cuda backend's Triton kernels against the reference ops.

Without a GPU the kernels run under the Triton interpreter on CPU tensors
(``harness.op_backend("cuda")`` gives ``CudaBackend(device="cpu")``); with one,
natively. The matrix: quant policies 0/8/4, block sizes 16/64, head dims
64/128 (96 once: padded to 128 with masks), GQA ratios 1/3, and a batch of
sequences of mixed lengths including 1 and an exact multiple of the block
size, for KV fill, decode (split-K) and prefill over paged history.
Larger sweeps are marked slow (``make test-all``).

Tolerances (docs/cuda.md): the fill is bit-identical to ``quant.quantize``
under the interpreter (on a GPU: levels within one, params exact);
attention is within ATOL/RTOL of the reference, a few units in the last
place of the output dtype.
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from harness import op_backend
from lmport import ops
from lmport.kv.layout import KVLayout, LayerCache

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
KV_HEADS = 2


@pytest.fixture(scope="module")
def cuda():
    """(backend, mode): mode "native" on a GPU, "interpreter" otherwise."""
    return op_backend("cuda")


def _kernels():
    from lmport.backends.cuda import decode_attention, prefill_attention  # TRITON_INTERPRET: tests/conftest.py
    return decode_attention, prefill_attention


def _sequences(block_size: int, decode: bool) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens): lengths 1 and exactly one block, a chunk over history, a short prompt."""
    kv_lens = [1, block_size, block_size + 21, 37]
    q_lens = [1] * 4 if decode else [1, block_size, 20, 37]
    return q_lens, kv_lens


def _setup(device, policy, block_size, head_dim, group, dtype, q_lens, kv_lens, seed=0):
    """A cache whose blocks (shuffled, block 0 unused) hold every sequence's KV, written by the
    reference fill; the step's metadata; and q. Returns (cache, meta, q)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in kv_lens]
    ids = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(ids[at:at + n])
        at += n
    cache = KVLayout(1, KV_HEADS, head_dim, block_size, dtype, policy).allocate(sum(blocks) + 1, device)[0]
    history = ops.build_attention_metadata(kv_lens, kv_lens, tables, block_size, device)
    tokens = sum(kv_lens)
    k = torch.randn(tokens, KV_HEADS, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, KV_HEADS, head_dim, generator=gen).to(dtype)
    ops.fill_kv_cache(k.to(device), v.to(device), cache, history.slot_mapping)
    meta = ops.build_attention_metadata(q_lens, kv_lens, tables, block_size, device)
    q = torch.randn(sum(q_lens), KV_HEADS * group, head_dim, generator=gen).to(dtype).to(device)
    return cache, meta, q


def _check_attention(out, q, cache, meta, head_dim):
    ref = ops.paged_attention(q, cache, meta, 1 / math.sqrt(head_dim))
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL[q.dtype])


def _unpack(values: torch.Tensor, policy: int) -> torch.Tensor:
    if policy == 4:
        values = torch.stack([values & 0xF, values >> 4], dim=-1).flatten(-2)
    return values.int()


def _assert_same_cache(got: LayerCache, want: LayerCache, exact: bool):
    for a, b in ((got.k, want.k), (got.v, want.v)):
        if got.quant_policy == 0 or exact:
            assert torch.equal(a, b)
        else:
            assert (_unpack(a, got.quant_policy) - _unpack(b, got.quant_policy)).abs().max() <= 1
    if got.quant_policy:
        assert torch.equal(got.k_qparams, want.k_qparams) and torch.equal(got.v_qparams, want.v_qparams)


# -- KV fill --------------------------------------------------------------------------------------

FILL_CASES = [(p, bs, d, dt) for p in (0, 8, 4) for bs in (16, 64) for d in (64, 128) for dt in (torch.float16,)]
FILL_CASES += [(p, 16, 96, dt) for p in (0, 8, 4) for dt in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("policy,block_size,head_dim,dtype", FILL_CASES)
def test_fill_kv_cache(cuda, policy, block_size, head_dim, dtype):
    backend, mode = cuda
    dev = backend.device
    q_lens, kv_lens = _sequences(block_size, decode=False)
    want, meta, _ = _setup(dev, policy, block_size, head_dim, 1, dtype, q_lens, kv_lens)
    got = LayerCache(want.k.clone(), want.v.clone(),
                     *(None if p is None else p.clone() for p in (want.k_qparams, want.v_qparams)),
                     policy, block_size)
    gen = torch.Generator().manual_seed(1)
    # Overwrite the step's slots with new values, including a constant row (the ZERO_LIMIT case)
    # and wide and tiny ranges, in non-contiguous k/v views (as split from a fused qkv).
    kv = torch.randn(meta.num_tokens, 2, KV_HEADS, head_dim, generator=gen)
    kv[0] = 3.0
    kv[1] *= 1e3
    kv[2] *= 1e-3
    kv = kv.to(dtype).to(dev)
    k, v = kv[:, 0], kv[:, 1]
    ops.fill_kv_cache(k, v, want, meta.slot_mapping)
    backend.fill_kv_cache(k, v, got, meta.slot_mapping)
    _assert_same_cache(got, want, exact=mode == "interpreter")


def test_fill_skips_negative_slots(cuda):
    """A padded row (slot -1, as in a CUDA-graph batch) writes nothing."""
    backend, _ = cuda
    for policy in (0, 8, 4):
        cache = KVLayout(1, KV_HEADS, 64, 16, torch.float16, policy).allocate(2, backend.device)[0]
        before = [t.clone() for t in (cache.k, cache.v, cache.k_qparams, cache.v_qparams) if t is not None]
        x = torch.randn(3, KV_HEADS, 64, dtype=torch.float16, device=backend.device)
        backend.fill_kv_cache(x, x, cache, torch.tensor([-1, 5, -1], device=backend.device))
        after = [t for t in (cache.k, cache.v, cache.k_qparams, cache.v_qparams) if t is not None]
        for b, a in zip(before, after):
            changed = (a != b).flatten(2).any(-1)            # [block, slot]
            assert changed.nonzero().tolist() in ([[0, 5]], [])
        assert (cache.k[0, 5] != 0).any()


# -- attention ------------------------------------------------------------------------------------

# Half the grid runs by default: for each policy the four (block size, head dim, GQA) rows of one parity, so every
# policy meets every block size, head dim and ratio, and every pair of those meets in every combination; the other
# half is slow (test_sweep covers more shapes there too).
MATRIX = [pytest.param(p, bs, d, g, id=f"q{p}-bs{bs}-d{d}-gqa{g}",
                       marks=() if (i + j + k + m) % 2 == 0 else pytest.mark.slow)
          for m, p in enumerate((0, 8, 4)) for i, bs in enumerate((16, 64)) for j, d in enumerate((64, 128))
          for k, g in enumerate((1, 3))]


@pytest.mark.parametrize("policy,block_size,head_dim,group", MATRIX)
def test_decode_attention(cuda, policy, block_size, head_dim, group):
    backend, _ = cuda
    q_lens, kv_lens = _sequences(block_size, decode=True)
    cache, meta, q = _setup(backend.device, policy, block_size, head_dim, group, torch.float16, q_lens, kv_lens)
    assert meta.is_decode
    out = backend.paged_attention(q, cache, meta, 1 / math.sqrt(head_dim))
    _check_attention(out, q, cache, meta, head_dim)


@pytest.mark.parametrize("policy,block_size,head_dim,group", MATRIX)
def test_prefill_attention(cuda, policy, block_size, head_dim, group):
    backend, _ = cuda
    q_lens, kv_lens = _sequences(block_size, decode=False)
    cache, meta, q = _setup(backend.device, policy, block_size, head_dim, group, torch.float16, q_lens, kv_lens)
    assert not meta.is_decode
    out = backend.paged_attention(q, cache, meta, 1 / math.sqrt(head_dim))
    _check_attention(out, q, cache, meta, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", [0, 8, 4])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_attention_dtypes_and_head_dim_96(cuda, dtype, policy, decode):
    backend, _ = cuda
    q_lens, kv_lens = _sequences(16, decode)
    cache, meta, q = _setup(backend.device, policy, 16, 96, 3, dtype, q_lens, kv_lens)
    out = backend.paged_attention(q, cache, meta, 1 / math.sqrt(96))
    _check_attention(out, q, cache, meta, 96)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_split_counts(cuda, num_splits):
    """Any split count merges to the same result, empty splits (short sequences) included."""
    backend, _ = cuda
    decode, _ = _kernels()
    q_lens, kv_lens = [1] * 3, [1, 200, 64]
    cache, meta, q = _setup(backend.device, 8, 16, 64, 3, torch.float16, q_lens, kv_lens)
    out = decode.decode_attention(q, cache, meta, 0.125, num_splits=num_splits)
    _check_attention(out, q, cache, meta, 64)


TILINGS = {"n32-codes": (32, 4, 2, True), "n64-codes": (64, 4, 2, True), "n128-w8-s3": (128, 8, 3, False)}
TILING_POLICIES = [(8, 64), (4, 64), (8, 96), (4, 96), (0, 64)]
TILING_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}
# A third of the grid runs by default, chosen so that every pair of tiling, policy and dtype still meets; the rest
# is slow.
TILING_CASES = [pytest.param(tiling, policy, head_dim, dtype, id=f"{t}-{policy}-{head_dim}-{d}",
                             marks=() if (i + j + k) % 3 == 0 else pytest.mark.slow)
                for i, (t, tiling) in enumerate(TILINGS.items())
                for j, (policy, head_dim) in enumerate(TILING_POLICIES)
                for k, (d, dtype) in enumerate(TILING_DTYPES.items())]


@pytest.mark.parametrize("tiling,policy,head_dim,dtype", TILING_CASES)
def test_decode_tilings(cuda, tiling, policy, head_dim, dtype):
    """Every tiling the kernel takes, K scored from its codes among them, matches the reference."""
    backend, _ = cuda
    decode, _ = _kernels()
    q_lens, kv_lens = [1] * 4, [1, 16, 200, 37]
    cache, meta, q = _setup(backend.device, policy, 16, head_dim, 3, dtype, q_lens, kv_lens)
    out = decode.decode_attention(q, cache, meta, 1 / math.sqrt(head_dim), tiling=decode.DecodeTiling(*tiling))
    _check_attention(out, q, cache, meta, head_dim)


def test_prefill_gpu_tiles(cuda):
    """The Hopper tile configuration (128 x 64, several query tiles) runs the same code path."""
    backend, _ = cuda
    _, prefill = _kernels()
    q_lens, kv_lens = [100, 1, 40], [200, 5, 40]
    cache, meta, q = _setup(backend.device, 4, 16, 128, 3, torch.float16, q_lens, kv_lens)
    out = prefill.prefill_attention(q, cache, meta, 1 / math.sqrt(128), config=(128, 64, 8, 2))
    _check_attention(out, q, cache, meta, 128)


def test_decode_with_padded_metadata(cuda):
    """A larger max_kv_len and wider block tables than the batch needs (a captured graph's fixed
    bounds) give the same result."""
    backend, _ = cuda
    q_lens, kv_lens = [1, 1], [17, 40]
    cache, meta, q = _setup(backend.device, 0, 16, 64, 1, torch.float16, q_lens, kv_lens)
    wide = torch.nn.functional.pad(meta.block_tables, (0, 30))
    padded = dataclasses.replace(meta, block_tables=wide, max_kv_len=32 * 16)
    out = backend.paged_attention(q, cache, padded, 0.125)
    _check_attention(out, q, cache, meta, 64)


def test_decode_graph_runner_padding(cuda):
    """DecodeGraphRunner pads a batch to a captured size: the padded rows write nothing and the real
    rows get what the eager step gives. (On CPU it runs the step eagerly on its padded buffers; the
    capture itself needs a GPU.)"""
    backend, _ = cuda
    from lmport.backends.cuda.graphs import DecodeGraphRunner
    gen = torch.Generator().manual_seed(3)
    dev, dim, heads = backend.device, 64, KV_HEADS * 3
    embed = torch.randn(50, heads * dim, generator=gen).half().to(dev)
    proj = torch.randn(heads * dim, 2 * KV_HEADS * dim, generator=gen).half().to(dev) / 16

    def make_step(cache):
        def step(ids, meta):
            x = embed[ids]
            k, v = (x @ proj).view(-1, 2, KV_HEADS, dim).unbind(1)
            backend.fill_kv_cache(k, v, cache, meta.slot_mapping)
            return backend.paged_attention(x.view(-1, heads, dim), cache, meta, 0.125)
        return step

    q_lens, kv_lens = [1, 1, 1], [5, 16, 30]
    eager_cache, meta, _ = _setup(dev, 8, 16, dim, 3, torch.float16, q_lens, kv_lens)
    graph_cache = LayerCache(eager_cache.k.clone(), eager_cache.v.clone(), eager_cache.k_qparams.clone(),
                             eager_cache.v_qparams.clone(), 8, 16)
    ids = torch.tensor([3, 7, 11], device=dev)
    runner = DecodeGraphRunner(make_step(graph_cache), max_blocks_per_seq=4, block_size=16, device=dev,
                               batch_sizes=(1, 4))
    runner.capture()
    assert runner.batch_size_for(3) == 4 and runner.batch_size_for(5) is None
    got = runner.run(ids, meta)
    want = make_step(eager_cache)(ids, meta)
    torch.testing.assert_close(got, want, **TOL[torch.float16])
    for a, b in ((graph_cache.k, eager_cache.k), (graph_cache.k_qparams, eager_cache.k_qparams)):
        assert torch.equal(a, b)


# -- the rest of the backend ------------------------------------------------------------------------

def test_torch_ops_are_the_reference(cuda):
    """copy_blocks, rms_norm and apply_rotary stay the reference torch ops (docs/cuda.md)."""
    backend, _ = cuda
    from lmport.platform.backend import Backend
    for name in ("copy_blocks", "rms_norm", "apply_rotary"):
        assert getattr(type(backend), name) is getattr(Backend, name)


def test_importing_the_backend_imports_no_triton():
    code = ("import sys, lmport.backends.cuda as c; c.CudaBackend.capabilities; c.CudaBackend.probe(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_benchmark_check_mode():
    """`lmport bench kernels cuda --check` runs its shape set (tiny) against the reference."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-m", "lmport", "bench", "kernels", "cuda", "--check", "--quick"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr


# -- larger sweep ------------------------------------------------------------------------------------

# fp16 and bf16 alternate over (block size, GQA) so each dtype meets every block size, head dim and ratio.
SWEEP = [(p, bs, d, g, (torch.float16, torch.bfloat16)[(bs == 128) ^ (g == 8)])
         for p in (0, 8, 4) for bs in (32, 128) for d in (80, 128) for g in (4, 8)]


@pytest.mark.slow
@pytest.mark.parametrize("policy,block_size,head_dim,group,dtype", SWEEP)
def test_sweep(cuda, policy, block_size, head_dim, group, dtype):
    backend, mode = cuda
    for decode in (True, False):
        q_lens, kv_lens = _sequences(block_size, decode)
        q_lens, kv_lens = q_lens + [1 if decode else 70], kv_lens + [3 * block_size + 70]
        cache, meta, q = _setup(backend.device, policy, block_size, head_dim, group, dtype, q_lens, kv_lens, seed=7)
        out = backend.paged_attention(q, cache, meta, 1 / math.sqrt(head_dim))
        _check_attention(out, q, cache, meta, head_dim)
        got = LayerCache(cache.k.clone(), cache.v.clone(),
                         *(None if p is None else p.clone() for p in (cache.k_qparams, cache.v_qparams)),
                         policy, block_size)
        x = (torch.randn(meta.num_tokens, KV_HEADS, head_dim) * 4).to(dtype).to(backend.device)
        ops.fill_kv_cache(x, x, cache, meta.slot_mapping)
        backend.fill_kv_cache(x, x, got, meta.slot_mapping)
        _assert_same_cache(got, cache, exact=mode == "interpreter")
