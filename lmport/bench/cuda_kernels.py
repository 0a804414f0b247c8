"""The cuda backend's Triton kernels: time on a GPU, or check their shape set on the interpreter.

With a GPU (default mode), at LLM-serving shapes (a Llama-3-8B-like attention,
32 query / 8 KV heads of 128, and a 64-dim model; batch 1-256, context
1k-32k), each kernel is timed (triton.testing.do_bench, median) against

- the reference op (lmport.ops, pure PyTorch: gathers and dequantizes the
  blocks, then SDPA with an explicit mask), and
- torch SDPA (flash attention) on contiguous, unpaged, unquantized K/V of the
  same lengths: the speed of light for 16-bit attention without paging,

and reports achieved memory bandwidth as a fraction of the device's peak
(decode, fill: memory-bound) or TFLOP/s as a fraction of peak (prefill).
Prints a markdown table; ``--out DIR`` writes the JSON there.

``--check`` runs the same shape set scaled down (heads, contexts and batches
divided) on the kernels, under the Triton interpreter on CPU when there is no
GPU, and compares every output with the reference op; exit status 1 on a
mismatch. ``--quick`` keeps a few shapes of each kind.

    lmport bench kernels cuda                   # GPU timings
    lmport bench kernels cuda --check           # correctness of the shape set
    lmport bench kernels cuda --check --quick
    lmport bench kernels cuda --tilings         # decode attention's tilings (GPU)
"""
from __future__ import annotations

import functools
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

if not torch.cuda.is_available():
    # Before anything imports triton: the kernels then run under the interpreter on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from lmport import ops  # noqa: E402
from lmport.backends.cuda import CudaBackend  # noqa: E402
from lmport.kv.layout import KVLayout, LayerCache  # noqa: E402
from lmport.bench.machine import describe  # noqa: E402

# Nominal peak HBM bandwidth (bytes/s) and dense 16-bit tensor TFLOP/s, by device-name substring.
PEAKS = {
    "H200": (4.8e12, 989e12), "H100 NVL": (3.9e12, 835e12), "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12), "H800": (3.35e12, 989e12), "A100-SXM4-80GB": (2.04e12, 312e12),
    "A100": (1.56e12, 312e12), "L40S": (0.864e12, 362e12), "A10": (0.6e12, 125e12),
}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    kind: str            # "decode", "prefill", "fill"
    batch: int           # sequences
    q_len: int           # new tokens a sequence (1 for decode)
    kv_len: int          # cached tokens a sequence after the step (history + new; fill: = q_len)
    q_heads: int
    kv_heads: int
    head_dim: int
    policy: int
    block_size: int = 64

    @property
    def name(self) -> str:
        hist = f"+{self.kv_len - self.q_len}" if self.kind == "prefill" and self.kv_len > self.q_len else ""
        return (f"{self.kind} b{self.batch} q{self.q_len}{hist} kv{self.kv_len} "
                f"h{self.q_heads}/{self.kv_heads}x{self.head_dim} int{self.policy or 16}")

    def tiny(self) -> Shape:
        """The --check version: the same kind, policy, GQA ratio and head dim, a CPU-sized batch."""
        group = self.q_heads // self.kv_heads
        q_len = 1 if self.kind == "decode" else max(1, self.q_len // 256)
        kv_len = max(q_len, self.kv_len // 256 + (self.kv_len - self.q_len) // 512)
        return replace(self, batch=min(self.batch, 3), q_len=q_len, kv_len=kv_len,
                       q_heads=min(self.kv_heads, 2) * group, kv_heads=min(self.kv_heads, 2),
                       block_size=16)


def shapes(quick: bool) -> list[Shape]:
    models = [(32, 8, 128), (16, 4, 64)]  # Llama-3-8B-like; a 64-dim head (SmolLM/Llama-style GQA 4)
    out = []
    for hq, hkv, d in models:
        for policy in (0, 8, 4):
            for batch in (1, 16, 64, 256):
                for ctx in (1024, 4096, 16384, 32768):
                    if batch * ctx <= 2 ** 21:  # KV tokens a layer: 2M (8 GiB at 16 bits for 8 heads)
                        out.append(Shape("decode", batch, 1, ctx, hq, hkv, d, policy))
            for batch, q_len, kv_len in ((1, 1024, 1024), (1, 4096, 4096), (1, 16384, 16384),
                                         (8, 2048, 2048), (1, 2048, 32768), (4, 512, 8192)):
                if policy != 4:
                    out.append(Shape("prefill", batch, q_len, kv_len, hq, hkv, d, policy))
            # A decode step's new tokens (one a sequence) and a long prompt's.
            out.append(Shape("fill", 256, 1, 1, hq, hkv, d, policy))
            out.append(Shape("fill", 1, 16384, 16384, hq, hkv, d, policy))
    if quick:
        keep = {("decode", 16, 4096), ("decode", 256, 1024), ("prefill", 1, 4096), ("prefill", 1, 32768),
                ("fill", 256, 1), ("fill", 1, 16384)}
        out = [s for s in out if (s.kind, s.batch, s.kv_len) in keep and s.head_dim == 128]
    return out


# -- inputs ---------------------------------------------------------------------------------------

def build(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(cache, meta, q, k_new, v_new): every sequence's KV in shuffled blocks, written by the reference."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, bs = shape.batch, shape.block_size
    q_len, kv_len = shape.q_len, shape.kv_len
    per_seq = -(-kv_len // bs)
    ids = (torch.randperm(b * per_seq, device=device, generator=gen) + 1).view(b, per_seq)
    cache = KVLayout(1, shape.kv_heads, shape.head_dim, bs, dtype, shape.policy).allocate(b * per_seq + 1, device)[0]
    meta = _metadata([q_len] * b, [kv_len] * b, ids, bs)
    if shape.kind != "fill":
        # Write the history through the reference fill, in chunks to bound its temporaries.
        full = _metadata([kv_len] * b, [kv_len] * b, ids, bs)
        chunk = 1 << 18
        for at in range(0, full.num_tokens, chunk):
            slots = full.slot_mapping[at:at + chunk]
            k = torch.randn(slots.numel(), shape.kv_heads, shape.head_dim, device=device, generator=gen)
            ops.fill_kv_cache(k.to(dtype), torch.randn_like(k).to(dtype), cache, slots)
    q = torch.randn(meta.num_tokens, shape.q_heads, shape.head_dim, device=device, generator=gen).to(dtype)
    k_new = torch.randn(meta.num_tokens, shape.kv_heads, shape.head_dim, device=device, generator=gen).to(dtype)
    return cache, meta, q, k_new, torch.randn_like(k_new)


def _metadata(q_lens, kv_lens, ids: torch.Tensor, block_size: int) -> ops.AttentionMetadata:
    """build_attention_metadata's result, built with tensor ops (serving shapes have millions of slots)."""
    device = ids.device
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32, device=device)
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    pos = torch.cat([torch.arange(k - q, k, device=device) for q, k in zip(q_lens, kv_lens)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=device), torch.tensor(q_lens, device=device))
    slots = ids[seq, pos // block_size].long() * block_size + pos % block_size
    start = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=device)
    start[1:] = torch.cumsum(q_lens_t, 0)
    return ops.AttentionMetadata(
        q_start_loc=start, q_lens=q_lens_t, kv_lens=kv_lens_t, block_tables=ids.to(torch.int32),
        slot_mapping=slots, positions=pos, block_size=block_size, max_q_len=max(q_lens),
        max_kv_len=max(kv_lens), is_decode=max(q_lens) == 1)


# -- what each kernel moves ----------------------------------------------------------------------------

def kv_bytes_per_token(shape: Shape, dtype: torch.dtype) -> int:
    """K and V bytes of one token in the cache: values plus (scale, zero)."""
    layout = KVLayout(1, shape.kv_heads, shape.head_dim, shape.block_size, dtype, shape.policy)
    return int(layout.bytes_per_token)


def work(shape: Shape, dtype: torch.dtype) -> tuple[float, float]:
    """(bytes moved, flops) of one call, the minimum any implementation must do."""
    item = dtype.itemsize
    tokens = shape.batch * shape.q_len
    qo = 2 * tokens * shape.q_heads * shape.head_dim * item
    if shape.kind == "fill":  # read K and V, write them quantized
        return tokens * (2 * shape.kv_heads * shape.head_dim * item + kv_bytes_per_token(shape, dtype)), 0.0
    kv = shape.batch * shape.kv_len * kv_bytes_per_token(shape, dtype)
    hist = shape.kv_len - shape.q_len
    # Causal pairs: each new token sees the history plus the new tokens up to itself.
    pairs = shape.batch * (shape.q_len * hist + shape.q_len * (shape.q_len + 1) / 2)
    return qo + kv, 4.0 * pairs * shape.q_heads * shape.head_dim


# -- the methods ----------------------------------------------------------------------------------------

def methods(shape: Shape, backend: CudaBackend, cache: LayerCache, meta, q, k_new, v_new, with_reference: bool):
    """{name: zero-argument callable} for this shape."""
    scale = 1 / math.sqrt(shape.head_dim)
    if shape.kind == "fill":
        out = {"triton": lambda: backend.fill_kv_cache(k_new, v_new, cache, meta.slot_mapping)}
        if with_reference:
            out["reference"] = lambda: ops.fill_kv_cache(k_new, v_new, cache, meta.slot_mapping)
        return out
    out = {"triton": lambda: backend.paged_attention(q, cache, meta, scale)}
    if with_reference:
        out["reference"] = lambda: ops.paged_attention(q, cache, meta, scale)
    if shape.kv_len == shape.q_len or shape.kind == "decode":
        # Flash attention on contiguous, unquantized K/V: [B, H, L, D].
        b = shape.batch
        qs = q.view(b, shape.q_len, shape.q_heads, shape.head_dim).transpose(1, 2)
        ks = torch.randn(b, shape.kv_heads, shape.kv_len, shape.head_dim, device=q.device, dtype=q.dtype)
        vs = torch.randn_like(ks)
        causal = shape.kind == "prefill"
        out["sdpa"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale,
                                                             enable_gqa=True)
    return out


def run_check(shape_list: list[Shape], dtype: torch.dtype, device: torch.device) -> list[dict]:
    backend = CudaBackend(device=device)
    rows = []
    for full in shape_list:
        shape = full.tiny()
        cache, meta, q, k_new, v_new = build(shape, dtype, device)
        t0 = time.perf_counter()
        if shape.kind == "fill":
            ref = LayerCache(*(None if t is None else t.clone() for t in (cache.k, cache.v, cache.k_qparams,
                                                                            cache.v_qparams)),
                             cache.quant_policy, cache.block_size)
            backend.fill_kv_cache(k_new, v_new, cache, meta.slot_mapping)
            ops.fill_kv_cache(k_new, v_new, ref, meta.slot_mapping)
            err = max(_level_diff(cache.k, ref.k, shape.policy), _level_diff(cache.v, ref.v, shape.policy))
            same_params = shape.policy == 0 or (torch.equal(cache.k_qparams, ref.k_qparams)
                                                and torch.equal(cache.v_qparams, ref.v_qparams))
            ok = same_params and err <= (0 if shape.policy == 0 else 1)   # levels within one, params exact
        else:
            out = backend.paged_attention(q, cache, meta, 1 / math.sqrt(shape.head_dim))
            ref = ops.paged_attention(q, cache, meta, 1 / math.sqrt(shape.head_dim))
            err = (out.float() - ref.float()).abs().max().item()
            ok = bool(torch.isfinite(out).all()) and err <= TOL[dtype] * (1 + ref.abs().max().item())
        rows.append(dict(shape=full.name, checked_as=shape.name, max_error=err, ok=ok,
                         seconds=round(time.perf_counter() - t0, 3)))
        print(f"{'ok  ' if ok else 'FAIL'} {full.name:<50} as {shape.name:<44} max err {err:.3g}", flush=True)
    return rows


def _level_diff(a: torch.Tensor, b: torch.Tensor, policy: int) -> float:
    if policy == 0:
        return (a.float() - b.float()).abs().max().item()
    if policy == 4:
        a, b = (torch.stack([x & 0xF, x >> 4], -1) for x in (a, b))
    return (a.int() - b.int()).abs().max().item()


def run_timing(shape_list: list[Shape], dtype: torch.dtype, device: torch.device) -> list[dict]:
    from triton.testing import do_bench
    backend = CudaBackend(device=device)
    name = torch.cuda.get_device_name(device)
    peak_bw, peak_flops = next((v for k, v in PEAKS.items() if k in name), (None, None))
    if peak_bw is None:
        peak_bw = measured_bandwidth(device)
    rows = []
    for shape in shape_list:
        torch.cuda.empty_cache()
        tokens = shape.batch * shape.kv_len
        inputs = build(shape, dtype, device)
        # The reference materializes a gathered, dequantized copy of every sequence's KV (and a mask).
        fns = methods(shape, backend, *inputs, with_reference=tokens <= 2 ** 19)
        moved, flops = work(shape, dtype)
        row: dict = dict(shape=shape.name, **asdict(shape), bytes=moved, flops=flops)
        for method, fn in fns.items():
            try:
                ms = do_bench(fn, warmup=10, rep=50)
            except torch.OutOfMemoryError:
                ms = None
            row[f"{method}_ms"] = ms
        ms = row["triton_ms"]
        row["bandwidth_fraction"] = moved / (ms * 1e-3) / peak_bw if ms else None
        row["tflops"] = flops / (ms * 1e-3) / 1e12 if ms and flops else None
        row["flops_fraction"] = flops / (ms * 1e-3) / peak_flops if ms and flops and peak_flops else None
        rows.append(row)
        print(_row_markdown(row), flush=True)
        del inputs, fns
    return rows


TILINGS = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 8, 2), (64, 4, 3), (64, 4, 4), (128, 8, 3)]


def run_tilings(dtype: torch.dtype, device: torch.device) -> list[dict]:
    """Decode attention under each tiling (tile tokens, warps, stages; a quantized K scored from its codes or
    dequantized), policies 0/8/4, at two serving shapes: ms, the fraction of a copy's bandwidth, and the
    largest difference from the default tiling's output (which the conformance tests hold to the reference)."""
    from triton.testing import do_bench

    from lmport.backends.cuda import decode_attention as decode
    copy_bw = measured_bandwidth(device)
    rows = []
    for batch, ctx in ((16, 4096), (256, 1024)):
        for policy in (0, 8, 4):
            shape = Shape("decode", batch, 1, ctx, 32, 8, 128, policy)
            cache, meta, q, _, _ = build(shape, dtype, device)
            attend = functools.partial(decode.decode_attention, q, cache, meta, 1 / math.sqrt(shape.head_dim))
            base = attend()
            moved, _ = work(shape, dtype)
            for codes in ((False, True) if policy else (False,)):
                for block_n, warps, stages in TILINGS:
                    tiling = decode.DecodeTiling(block_n, warps, stages, codes)
                    try:
                        diff = (attend(tiling=tiling).float() - base.float()).abs().max().item()
                        ms = float(do_bench(functools.partial(attend, tiling=tiling), warmup=10, rep=50))
                    except Exception as exc:   # a tiling Triton cannot compile for this GPU: recorded, not fatal
                        rows.append(dict(shape=shape.name, tiling=tiling._asdict(), error=str(exc)[:300]))
                        print(f"| {shape.name} | {tuple(tiling)} | failed: {str(exc)[:100]} |", flush=True)
                        continue
                    copy_fraction = moved / (ms * 1e-3) / copy_bw
                    rows.append(dict(shape=shape.name, tiling=tiling._asdict(), ms=ms, max_diff=diff,
                                     copy_fraction=copy_fraction))
                    print(f"| {shape.name} | {tuple(tiling)} | {ms:.3f} | {100 * copy_fraction:.0f}% | "
                          f"{diff:.2g} |", flush=True)
            del attend, base
            torch.cuda.empty_cache()
    return rows


def measured_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy: a stand-in for an unknown device's peak."""
    from triton.testing import do_bench
    x = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / (float(do_bench(lambda: y.copy_(x))) * 1e-3)


HEADER = ("| shape | triton ms | reference ms | sdpa ms | vs ref | vs sdpa | BW % peak | TFLOP/s (% peak) |\n"
          "|---|---|---|---|---|---|---|---|")


def _row_markdown(r: dict) -> str:
    def ms(key):
        return f"{r[key]:.3f}" if r.get(key) else "-"

    def ratio(key):
        return f"{r[key] / r['triton_ms']:.1f}x" if r.get(key) and r.get("triton_ms") else "-"
    bw = f"{100 * r['bandwidth_fraction']:.0f}%" if r.get("bandwidth_fraction") else "-"
    tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
    if r.get("flops_fraction"):
        tf += f" ({100 * r['flops_fraction']:.0f}%)"
    return (f"| {r['shape']} | {ms('triton_ms')} | {ms('reference_ms')} | {ms('sdpa_ms')} | "
            f"{ratio('reference_ms')} | {ratio('sdpa_ms')} | {bw} | {tf} |")


def run(args) -> tuple[dict, int]:
    """The rows measured or checked, printed as they come; the result for its JSON, and the exit status (1: a
    shape that does not match the reference, 2: nothing to do without a GPU)."""
    dtype = DTYPES[args.dtype]
    gpu = torch.cuda.is_available()
    if not gpu and not args.check:
        print("no CUDA device: timings need a GPU; run with --check to check the shape set on the "
              "Triton interpreter", file=sys.stderr)
        return {}, 2
    device = torch.device("cuda" if gpu else "cpu")
    shape_list = shapes(args.quick)
    env = dict(python=platform.python_version(), torch=torch.__version__,
               device=torch.cuda.get_device_name(device) if gpu else "cpu (Triton interpreter)",
               dtype=args.dtype, mode="tilings" if args.tilings else "check" if args.check else "timing")
    if args.tilings:
        if not gpu:
            print("--tilings times kernels: it needs a GPU", file=sys.stderr)
            return {}, 2
        print("| shape | tiling (tokens, warps, stages, K from codes) | ms | of copy BW | diff from default |\n"
              "|---|---|---|---|---|", flush=True)
        rows = run_tilings(dtype, device)
        failed = []
    elif args.check:
        rows = run_check(shape_list, dtype, device)
        failed = [r for r in rows if not r["ok"]]
        print(f"\n{len(rows) - len(failed)}/{len(rows)} shapes match the reference ({env['device']})")
    else:
        print(HEADER, flush=True)
        rows = run_timing(shape_list, dtype, device)
        failed = []
    result = dict(benchmark="kernels", backend="cuda", env=env, machine=describe(torch.get_num_threads(), 0.25),
                  rows=rows)
    return result, 1 if failed else 0
