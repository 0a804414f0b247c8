"""Single-stream decode with this checkout's cpu kernels against another checkout's, paired round by round.

A change to the C++ kernels is judged by this: the same engine (this checkout's Python) on the same GGUF
file in two worker processes, one built from this checkout's lmport/backends/cpu/csrc and one from --base's
(``kernels.CSRC``; its Python must call both builds alike). The workers take turns round by round, in
the order A B B A ..., so the memory bandwidth a shared host gives, which drifts over seconds and
minutes, falls on both alike; each round's ratio compares two runs made seconds apart. The table
gives each side's median (min-max) tok/s and the median (min-max) of the per-round ratios.

- decode: 64 tokens at context depth 0 (after a one-token prompt) and at depth 256, as single_stream.py.
- LMPORT_CPU_ISA applies to both workers (avx2: both AVX2 builds); --kv-cache-dtype to both engines (default
  float16, as single_stream.py; auto for a base whose kernels read only float32 caches).

    git worktree add /tmp/base HEAD~1
    .venv/bin/python benchmarks/kernel_ab.py --base /tmp/base [--files Q8_0,Q4_K_M] [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gguf_files import DEFAULT_DIR, DEFAULT_LLAMA_BIN, TYPES, add_kv_cache_dtype_argument, files_by_label
from machine import cpu_info, median_min_max, memory_bandwidth, write_result
from worker_process import WorkerProcess, step

PROMPT_TOKENS, DECODE_TOKENS = 256, 64
DEPTHS = (0, PROMPT_TOKENS)


def worker(model: Path, csrc: Path, threads: int, kv_cache_dtype: str) -> WorkerProcess:
    """This script run as ``--worker FILE CSRC``: one engine on kernels built from CSRC, a round per request."""
    return WorkerProcess([sys.executable, __file__, "--worker", str(model), str(csrc), "--threads", str(threads),
                          "--kv-cache-dtype", kv_cache_dtype])


def worker_main(model: str, csrc: str, threads: int, kv_cache_dtype: str) -> None:
    import torch
    torch.set_num_threads(threads)
    from lmport.backends.cpu import kernels
    kernels.CSRC = Path(csrc)
    from lmport.config import EngineConfig, GenerationConfig
    from lmport.engine.engine import Engine
    engine = Engine(model, EngineConfig(device_type="cpu", cache_max_entry_count=40,
                                        max_prefill_token_num=PROMPT_TOKENS, kv_cache_dtype=kv_cache_dtype))
    prompt = engine.tokenizer.encode("Paged attention keeps keys and values in fixed-size blocks. " * 40)
    prompt = prompt[:PROMPT_TOKENS]

    def decode(depth: int) -> float:
        """Decode tok/s of DECODE_TOKENS tokens after ``depth`` tokens of context (the prompt's step left out)."""
        engine.add_request(prompt[:max(depth, 1)], GenerationConfig(max_new_tokens=1 + DECODE_TOKENS, ignore_eos=True))
        step(engine)
        start = time.perf_counter()
        while engine.has_unfinished():
            step(engine)
        return DECODE_TOKENS / (time.perf_counter() - start)

    compiled = kernels.load()
    if compiled is None:
        raise SystemExit(f"the cpu kernels from {csrc} did not build (see the log above)")
    for depth in DEPTHS:   # warm-up: caches touched
        decode(depth)
    print(json.dumps({"kernels": compiled.__name__, "csrc": csrc}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({f"decode@{d}": decode(d) for d in DEPTHS}), flush=True)


def rounded(values: list[float], digits: int) -> dict:
    return {k: round(v, digits) for k, v in median_min_max(values).items()}


def summary(rounds: list[dict], a: str, b: str) -> dict:
    out = {}
    for d in DEPTHS:
        key = f"decode@{d}"
        out[key] = {a: rounded([r[a][key] for r in rounds], 1), b: rounded([r[b][key] for r in rounds], 1),
                    "B / A": rounded([r[b][key] / r[a][key] for r in rounds], 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="the other checkout (its lmport/backends/cpu/csrc is built as A)")
    ap.add_argument("--files", default="Q8_0,Q4_K_M", help=f"among {', '.join(TYPES)}, or paths of GGUF files")
    ap.add_argument("--files-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN, help="llama-quantize, for a missing file")
    ap.add_argument("--threads", type=int, default=2)
    add_kv_cache_dtype_argument(ap)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/kernel_ab.json")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(*args.worker, args.threads, args.kv_cache_dtype)
    if args.base is None or not (args.base / "backends" / "cpu" / "csrc" / "kernels.cpp").is_file():
        raise SystemExit(f"--base {args.base}: give a checkout of lmport (with lmport/backends/cpu/csrc/kernels.cpp), "
                         "e.g. from `git worktree add /tmp/base HEAD~1`")
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2 (each build leads every other round)")
    csrc = {"A (base)": args.base / "backends" / "cpu" / "csrc",
            "B (this checkout)": Path(__file__).resolve().parents[1] / "backends" / "cpu" / "csrc"}
    names = [f for f in args.files.split(",") if f]
    files = files_by_label(names, args.files_dir, args.llama_bin)
    results = {"machine": cpu_info(), "threads": args.threads, "isa": os.environ.get("LMPORT_CPU_ISA", "native"),
               "kv_cache_dtype": args.kv_cache_dtype,
               "csrc": {k: str(v) for k, v in csrc.items()}, "bandwidth": memory_bandwidth(args.threads), "files": {}}
    a, b = csrc
    for label, path in files.items():
        workers = {side: worker(path, src, args.threads, args.kv_cache_dtype) for side, src in csrc.items()}
        rounds = []
        for i in range(args.rounds):
            order = [a, b] if i % 2 == 0 else [b, a]
            rounds.append({side: workers[side].round() for side in order})
            print(f"{label} round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
        for w in workers.values():
            w.close()
        results["files"][label] = {"path": str(path), "rounds": rounds, "summary": summary(rounds, a, b),
                                   "kernels": {side: w.info["kernels"] for side, w in workers.items()}}
    results["bandwidth_after"] = memory_bandwidth(args.threads)
    print_table(results)
    write_result(args.out, results)


def print_table(results: dict) -> None:
    m = results["machine"]
    print(f"\n{m['model']}, {m['cores']} cores ({' '.join(m['kernel_flags'])}), kernels {results['isa']}, "
          f"{results['threads']} threads, K/V {results['kv_cache_dtype']}; "
          f"read bandwidth {results['bandwidth']['best_gbs']:.1f} GB/s "
          f"({results['bandwidth_after']['best_gbs']:.1f} after); A: {results['csrc']['A (base)']}\n")
    print("| file | decode | A tok/s | B tok/s | B / A, per round |")
    print("|---|---|---:|---:|---:|")
    cell = lambda s, d: f"{s['median']:.{d}f} ({s['min']:.{d}f}-{s['max']:.{d}f})"   # noqa: E731
    for label, f in results["files"].items():
        for measure, s in f["summary"].items():
            print(f"| {label} | {measure} | {cell(s['A (base)'], 1)} | {cell(s['B (this checkout)'], 1)} | "
                  f"{cell(s['B / A'], 3)} |")


if __name__ == "__main__":
    main()
