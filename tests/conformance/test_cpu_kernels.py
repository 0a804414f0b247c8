"""The cpu backend's C++ kernels (paged attention, small-batch linear, RMSNorm, rotary,
silu-and-mul) against the reference ops.

The kernel must build here (gcc and ninja are part of the test environment):
a build that silently fell back to the reference ops would leave it untested.
Attention matrix: block sizes 1/16/64, head dims 64/128, GQA groups 1/3/4 (the AVX-512 path takes
a KV head's query heads three at a time: 4 leaves one over), float32 and float16 caches (a float32
model's kv_cache_dtype="float16"), decode and mixed prefill batches (a chunk over cached history, a
block-exact sequence, a one-token sequence). Tolerance: fp32 summation order only, 2e-5 (the float16
values are the reference's too).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmport import ops
from lmport.backends.cpu import SMALL_BATCH_TOKENS, CpuBackend, kernels, malloc
from lmport.kv.layout import KVLayout

TOL = dict(atol=2e-5, rtol=2e-5)
KV_HEADS = 2
BATCHES = {
    "decode": lambda bs: ([1, 1, 1, 1], [1, bs, bs + 21, 300]),
    "mixed": lambda bs: ([1, bs, 20, 37], [1, bs, bs + 20, 37]),
}


def _case(block_size, head_dim, group, q_lens, kv_lens, dtype=torch.float32, policy=0, seed=0, cache_dtype=None):
    """A cache (of ``cache_dtype``, default ``dtype``) on shuffled blocks holding every sequence's KV, the step's
    metadata, and q."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in kv_lens]
    ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    tables = [ids[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
    cache = KVLayout(1, KV_HEADS, head_dim, block_size, cache_dtype or dtype, policy).allocate(sum(counts) + 1,
                                                                                               "cpu")[0]
    history = ops.build_attention_metadata(kv_lens, kv_lens, tables, block_size)
    k, v = (torch.randn(sum(kv_lens), KV_HEADS, head_dim, generator=gen).to(dtype) for _ in range(2))
    ops.fill_kv_cache(k, v, cache, history.slot_mapping)
    meta = ops.build_attention_metadata(q_lens, kv_lens, tables, block_size)
    q = torch.randn(sum(q_lens), KV_HEADS * group, head_dim, generator=gen).to(dtype)
    return cache, meta, q


def test_kernel_builds_here():
    assert kernels.load() is not None, "the cpu kernels failed to build; see the warning logged by kernels.load"
    # Built for this CPU (-march=native): the build is named after it (and the instruction sets asked for).
    assert kernels.load().__name__ == kernels.build_name()
    assert kernels.build_name().startswith(f"lmport_cpu_kernels_{kernels.machine_tag()}_{kernels.source_tag()}")


@pytest.mark.parametrize("cache_dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize("group", (1, 3, 4))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("block_size", (1, 16, 64))
def test_paged_attention_matches_reference(block_size, head_dim, group, kind, cache_dtype):
    cache, meta, q = _case(block_size, head_dim, group, *BATCHES[kind](block_size), cache_dtype=cache_dtype)
    scale = head_dim ** -0.5
    out = kernels.load().paged_attention(q, cache.k, cache.v, meta.block_tables, meta.q_start_loc,
                                          meta.kv_lens, scale)
    torch.testing.assert_close(out, ops.paged_attention(q, cache, meta, scale), **TOL)
    torch.testing.assert_close(CpuBackend().paged_attention(q, cache, meta, scale), out, atol=0, rtol=0)


@pytest.mark.parametrize("cache_dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("q_lens,kv_lens", [([1], [37]), ([1, 1, 1], [5, 16, 300]), ([20, 37], [20, 40])], ids=str)
def test_fill_kv_cache_matches_reference(q_lens, kv_lens, cache_dtype):
    """The reference's values bit for bit; into a float16 cache rounded as torch rounds (to nearest even, a
    tie among the values), huge values to infinity, tiny ones to float16's subnormals."""
    cache, meta, _ = _case(16, 64, 1, q_lens, kv_lens, cache_dtype=cache_dtype)
    k, v = (torch.randn(sum(q_lens), KV_HEADS, 64) for _ in range(2))
    k[0, 0, :6] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 7e4, -1e9, 3e-7, 65519.0])
    want = KVLayout(1, KV_HEADS, 64, 16, cache_dtype, 0).allocate(cache.k.shape[0], "cpu")[0]
    want.k.copy_(cache.k)
    want.v.copy_(cache.v)
    ops.fill_kv_cache(k, v, want, meta.slot_mapping)
    CpuBackend().fill_kv_cache(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)
    with pytest.raises(RuntimeError, match="slot -1 of token 0 is outside"):
        kernels.load().fill_kv_cache(k[:1], v[:1], cache.k, cache.v, torch.tensor([-1]))


@pytest.mark.parametrize("policy", (8, 4))
@pytest.mark.parametrize("head_dim", (64, 96))
def test_fill_of_codes_is_the_references_bits(policy, head_dim):
    """8- and 4-bit fills: the codes and params of lmport.kv.quant.quantize, bit for bit, including rows that
    are constant, far from 0 with a tiny range (the zero limit), or huge."""
    cache, meta, _ = _case(16, head_dim, 1, [1, 1, 20], [5, 16, 40], policy=policy)
    gen = torch.Generator().manual_seed(policy + head_dim)
    k, v = (torch.randn(22, KV_HEADS, head_dim, generator=gen) for _ in range(2))
    k[0] = 3.0                                                     # constant rows
    k[1] = 1e4 + torch.rand(KV_HEADS, head_dim, generator=gen)     # |min| / range beyond the zero limit
    v[2] = torch.randn(KV_HEADS, head_dim, generator=gen) * 1e30   # huge
    want = KVLayout(1, KV_HEADS, head_dim, 16, torch.float32, policy).allocate(cache.k.shape[0], "cpu")[0]
    for name in ("k", "v", "k_qparams", "v_qparams"):
        getattr(want, name).copy_(getattr(cache, name))
    ops.fill_kv_cache(k, v, want, meta.slot_mapping)
    CpuBackend().fill_kv_cache(k, v, cache, meta.slot_mapping)
    for name in ("k", "v", "k_qparams", "v_qparams"):
        assert torch.equal(getattr(cache, name), getattr(want, name)), name


@pytest.mark.parametrize("cache_dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("threads", (2, 3, 8))
@pytest.mark.parametrize("kv_lens", ([1], [5], [300], [7, 300]), ids=str)
@pytest.mark.parametrize("window", (0, 40))
def test_decode_attention_split_over_threads_matches_reference(threads, kv_lens, window, cache_dtype):
    """Fewer decode tokens than threads: each token's keys are split into parts (some empty when
    there are fewer keys than parts) whose softmax statistics merge them."""
    cache, meta, q = _case(16, 64, 3, [1] * len(kv_lens), kv_lens, cache_dtype=cache_dtype)
    meta = meta.for_layer(window or None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.load().paged_attention(q, cache.k, cache.v, meta.block_tables, meta.q_start_loc,
                                              meta.kv_lens, 0.125, window)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ops.paged_attention(q, cache, meta, 0.125), **TOL)


@pytest.mark.parametrize("policy", (8, 4))
@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize("group", (1, 3))
@pytest.mark.parametrize("head_dim", (64, 96, 128))
@pytest.mark.parametrize("block_size", (1, 16))
def test_paged_attention_over_codes_matches_reference(block_size, head_dim, group, kind, policy):
    """8- and 4-bit caches: q . (code - zero) times the scale, against the reference's dequantized values."""
    cache, meta, q = _case(block_size, head_dim, group, *BATCHES[kind](block_size), policy=policy)
    out = CpuBackend().paged_attention(q, cache, meta, 0.125)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ops.paged_attention(q, cache, meta, 0.125), **TOL)
    windowed = meta.for_layer(40)
    torch.testing.assert_close(CpuBackend().paged_attention(q, cache, windowed, 0.125),
                               ops.paged_attention(q, cache, windowed, 0.125), **TOL)


@pytest.mark.parametrize("dtype,policy,head_dim,cache_dtype", [
    (torch.bfloat16, 8, 64, None), (torch.bfloat16, 0, 64, None), (torch.float32, 0, 36, None),
    (torch.float32, 8, 36, None), (torch.float32, 0, 64, torch.bfloat16), (torch.float16, 0, 64, None)])
def test_cases_the_kernel_does_not_cover_use_the_reference(dtype, policy, head_dim, cache_dtype):
    cache, meta, q = _case(16, head_dim, 3, *BATCHES["mixed"](16), dtype=dtype, policy=policy,
                           cache_dtype=cache_dtype)
    out = CpuBackend().paged_attention(q, cache, meta, 0.125)
    assert torch.equal(out, ops.paged_attention(q, cache, meta, 0.125))


def test_kernels_off_by_environment():
    code = "from lmport.backends.cpu import kernels; print(kernels.load())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LMPORT_CPU_KERNELS": "0"})
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stdout + proc.stderr


def test_the_engine_loads_the_kernels_before_its_first_request(monkeypatch):
    """A build (a compiler of about 2 GB for a minute) must not happen inside the first request a server
    takes: the engine has the kernels once it is constructed, before any step."""
    from lmport.config import EngineConfig
    from lmport.engine.engine import Engine
    from support.model_helpers import tiny_model_dir
    loads = []
    monkeypatch.setattr(kernels, "load", lambda: loads.append(1))
    engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", cache_max_entry_count=32))
    try:
        assert loads and engine.stats["steps"] == 0
    finally:
        engine.close()


def test_one_build_per_source_version_wherever_the_sources_lie(tmp_path):
    """The build compiles a copy of csrc kept in its own directory, made once: a build file naming the
    copy is the same for every checkout, and an untouched copy gives ninja nothing to rebuild."""
    assert kernels.build_directory().name == kernels.build_name()
    sources = kernels.staged_sources(tmp_path)
    copied = sorted(p for p in (tmp_path / "csrc").rglob("*") if p.is_file())
    assert [p.relative_to(tmp_path / "csrc") for p in copied] == [p.relative_to(kernels.CSRC)
                                                                   for p in kernels.source_files()]
    assert sources == [str(tmp_path / "csrc" / name) for name in kernels.SOURCES]
    assert {p.name for p in kernels.CSRC.glob("*.cpp")} == set(kernels.SOURCES)   # every translation unit built
    mtimes = {p: p.stat().st_mtime_ns for p in copied}
    assert kernels.staged_sources(tmp_path) == sources
    assert {p: p.stat().st_mtime_ns for p in copied} == mtimes
    assert Path(kernels.load().__file__).parent == kernels.build_directory()


def test_a_build_marked_complete_loads_without_torchs_builder(monkeypatch):
    """A completed build is imported directly: no lock file, no ninja (a lock left by a killed process made
    every later load wait forever). A library changed since it was marked goes back to torch's builder."""
    assert kernels.load() is not None
    directory = kernels.build_directory()
    assert (directory / kernels.BUILT).exists()

    def no_builder(*args, **kwargs):
        raise AssertionError("torch's builder was called for a build marked complete")
    monkeypatch.setattr("torch.utils.cpp_extension.load", no_builder)
    module = kernels.load.__wrapped__()
    assert module is not None and module.__name__ == kernels.build_name()
    assert set(module.ggml_types()) == kernels.GGML_TYPES
    name, size, _ = (directory / kernels.BUILT).read_text().split()
    assert kernels._load_built(directory) is not None
    (directory / kernels.BUILT).write_text(f"{name} {size} 0\n")   # as if the library were rebuilt since
    try:
        assert kernels._load_built(directory) is None
    finally:
        kernels._mark_built(directory, directory / name)


def test_instruction_sets_chosen_by_environment(monkeypatch):
    """LMPORT_CPU_ISA=avx2 builds without AVX-512 (a build of its own); an unknown value is an error
    naming it, not a silent fallback to the reference ops. (The AVX2 build itself is tested by running
    these tests under LMPORT_CPU_ISA=avx2.)"""
    monkeypatch.delenv("LMPORT_CPU_ISA", raising=False)
    assert kernels.isa_flags() == ["-march=native"]
    monkeypatch.setenv("LMPORT_CPU_ISA", "avx2")
    assert kernels.isa_flags() == ["-march=native", "-mno-avx512f"]
    monkeypatch.setenv("LMPORT_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="LMPORT_CPU_ISA='sse2'"):
        kernels.isa_flags()


@pytest.fixture
def float32_gemm():
    """The prefill GEMMs in float32 whatever LMPORT_CPU_PREFILL says (the cases compare with torch's float32)."""
    kernels.set_bf16_gemm(False)
    yield
    kernels.set_bf16_gemm(kernels.prefill_precision() == "bf16")


@pytest.mark.parametrize("rows", (1, 2, 3, 4, 7, 16, SMALL_BATCH_TOKENS, SMALL_BATCH_TOKENS + 1, 300))
@pytest.mark.parametrize("out_features", (160, 163))  # 163: rows left over from the four-row tiles
@pytest.mark.parametrize("bias", (False, True))
def test_linear_matches_torch(rows, out_features, bias, float32_gemm):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(out_features, 96, generator=gen) / 96 ** 0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    out = CpuBackend().linear(x, w, b)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, w, b), **TOL)
    transposed = x.t().contiguous().t()
    torch.testing.assert_close(CpuBackend().linear(transposed, w, b), F.linear(x, w, b), **TOL)


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("onednn", (True, False))
def test_prefill_gemm_over_an_expanded_weight_matches_torch(bias, onednn, monkeypatch, float32_gemm):
    """Prefill's GEMM (oneDNN where torch has it, else F.linear) gives F.linear's result up to the order of
    the float32 sums, with or without oneDNN."""
    import lmport.backends.cpu as cpu
    if onednn and cpu.onednn_linear() is None:
        pytest.skip("this torch has no oneDNN linear")
    if not onednn:
        monkeypatch.setattr(cpu, "onednn_linear", lambda: None)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(200, 576, generator=gen), torch.randn(300, 576, generator=gen) / 576 ** 0.5
    b = torch.randn(300, generator=gen) if bias else None
    torch.testing.assert_close(cpu.prefill_gemm(x, w, b), F.linear(x, w, b), **TOL)


def test_linear_with_in_features_off_the_vector_width_uses_torch():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 36, generator=gen), torch.randn(20, 36, generator=gen)
    assert torch.equal(CpuBackend().linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("shape", [(5, 576), (3, 4, 64), (1, 100)])
def test_rms_norm_matches_reference(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(*shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
    out = CpuBackend().rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, ops.rms_norm(x, w, 1e-5), **TOL)
    strided = torch.randn(shape[-1], 5, generator=gen).t()  # dense but not contiguous
    torch.testing.assert_close(CpuBackend().rms_norm(strided, w, 1e-5), ops.rms_norm(strided, w, 1e-5), **TOL)


@pytest.mark.parametrize("tokens,head_dim", [(1, 64), (37, 64), (300, 128), (4, 6)])
def test_rotary_matches_reference(tokens, head_dim):
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(head_dim * 9, tokens, generator=gen).t().unflatten(-1, (9, head_dim))  # dense but not contiguous
    k = torch.randn(tokens, 3, head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = CpuBackend().apply_rotary(q, k, cos, sin)
    for g, want in zip(got, ops.apply_rotary(q, k, cos, sin)):
        assert g.is_contiguous()
        torch.testing.assert_close(g, want, **TOL)


@pytest.mark.parametrize("transposed", (False, True))
@pytest.mark.parametrize("shape", [(5, 1536), (300, 20), (1, 7)])
def test_silu_and_mul_matches_reference(shape, transposed):
    gen = torch.Generator().manual_seed(shape[0])
    gate, up = (torch.randn(*shape, generator=gen) * 4 for _ in range(2))
    if transposed:  # dense but not contiguous
        gate, up = gate.t().contiguous().t(), up.t().contiguous().t()
    out = CpuBackend().silu_and_mul(gate, up)
    torch.testing.assert_close(out, ops.silu_and_mul(gate.clone(), up), **TOL)


def test_kernels_refuse_what_they_do_not_cover_with_a_clear_error():
    cache, meta, q = _case(16, 64, 3, *BATCHES["mixed"](16))
    compiled = kernels.load()
    with pytest.raises(RuntimeError, match="float32"):
        compiled.paged_attention(q.bfloat16(), cache.k, cache.v, meta.block_tables, meta.q_start_loc,
                                 meta.kv_lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim % 8 == 0"):
        odd, odd_meta, odd_q = _case(16, 36, 3, *BATCHES["mixed"](16))
        compiled.paged_attention(odd_q, odd.k, odd.v, odd_meta.block_tables, odd_meta.q_start_loc,
                                 odd_meta.kv_lens, 0.125)
    args = (cache.k, cache.v, meta.block_tables, meta.q_start_loc, meta.kv_lens, 0.125)
    with pytest.raises(RuntimeError, match=r"the caches \[blocks, block_size, kv_heads, head_dim\] alike"):
        compiled.paged_attention(q[..., :32].contiguous(), *args)
    with pytest.raises(RuntimeError, match=r"q_start_loc \[B \+ 1\] ending at the"):
        compiled.paged_attention(q[:-1].contiguous(), *args)
    codes, codes_meta, codes_q = _case(16, 64, 3, *BATCHES["mixed"](16), policy=8)
    step = (codes_meta.block_tables, codes_meta.q_start_loc, codes_meta.kv_lens, 0.125)
    params = (codes.k_qparams, codes.v_qparams)
    with pytest.raises(RuntimeError, match="8- or 4-bit codes, got 5"):
        compiled.paged_attention_codes(codes_q, codes.k, codes.v, *params, 5, *step)
    with pytest.raises(RuntimeError, match="float32 q and params and uint8 caches"):
        compiled.paged_attention_codes(codes_q, codes.k, codes.v, *(p.half() for p in params), 8, *step)
    with pytest.raises(RuntimeError, match=r"head_dim \* bits / 8\] and their params"):
        compiled.paged_attention_codes(codes_q, codes.k, codes.v, *params, 4, *step)
    new_rows = torch.ones(3, KV_HEADS, 64)
    with pytest.raises(RuntimeError, match="8- or 4-bit codes, got 2"):
        compiled.fill_kv_cache_codes(new_rows, new_rows, codes.k, codes.v, *params, 2, torch.arange(3))
    with pytest.raises(RuntimeError, match=r"k and v are \[3 tokens, 2 kv_heads, 64\]"):
        compiled.fill_kv_cache_codes(new_rows[..., :32], new_rows[..., :32], codes.k, codes.v, *params, 8,
                                     torch.arange(3))
    with pytest.raises(RuntimeError, match="slot -1 of token 0 is outside"):
        compiled.fill_kv_cache_codes(new_rows, new_rows, codes.k, codes.v, *params, 8, torch.tensor([-1, 0, 1]))
    with pytest.raises(RuntimeError, match="differ in shape"):
        compiled.silu_and_mul(torch.ones(2, 8), torch.ones(2, 16))
    with pytest.raises(RuntimeError, match="weight has 3 elements"):
        compiled.rms_norm(torch.ones(2, 8), torch.ones(3), 1e-5)
    with pytest.raises(RuntimeError, match=r"cos and sin are \[tokens, head_dim\]"):
        compiled.apply_rotary(torch.ones(3, 2, 8), torch.ones(3, 1, 8), torch.ones(2, 8), torch.ones(2, 8))
    with pytest.raises(RuntimeError, match=r"k \[tokens, kv_heads, head_dim\]"):
        compiled.apply_rotary(torch.ones(3, 2, 8), torch.ones(4, 1, 8), torch.ones(3, 8), torch.ones(3, 8))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        compiled.small_linear(torch.ones(2, 12), torch.ones(4, 12))
    with pytest.raises(RuntimeError, match=r"x is \[tokens, in\], weight \[out, in\]"):
        compiled.small_linear(torch.ones(2, 16), torch.ones(4, 8))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")
def test_cpu_backend_keeps_freed_step_memory_in_the_heap():
    CpuBackend()
    assert malloc.keep_freed_memory()
