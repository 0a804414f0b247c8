"""Single-stream prefill and decode of this checkout against another checkout, paired round by round.

A change to the C++ kernels is judged by this: the same GGUF file decoded in two worker processes, each running
its own checkout's code (its lmport package first on the path, so its Python and the kernels built from its own
lmport/backends/cpu/csrc; the builds are named after their sources, so they never meet). Only the engine's public
pieces (Engine, EngineConfig, GenerationConfig) are used, so a checkout from long ago measures as today's does.
The workers take turns round by round, in the order A B B A ..., so the memory bandwidth a shared host gives,
which drifts over seconds and minutes, falls on both alike; each round's ratio compares two runs made seconds
apart. The table gives each side's median (min-max) tok/s and the median (min-max) of the per-round ratios.

- prefill: a 256-token prompt in one step (its first token included), as single_stream.py.
- decode: 64 tokens at context depth 0 (after a one-token prompt) and at depth 256, as single_stream.py.
- LMPORT_CPU_ISA applies to both workers (avx2: both AVX2 builds); --kv-cache-dtype to both engines (default
  float16, as single_stream.py; auto for a base whose kernels read only float32 caches).
- Both workers run this interpreter (its torch and other packages); only the lmport package differs.

    git worktree add /tmp/base HEAD~1
    .venv/bin/python benchmarks/kernel_ab.py --base /tmp/base [--files Q8_0,Q4_K_M] [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gguf_files import DEFAULT_DIR, DEFAULT_LLAMA_BIN, TYPES, add_kv_cache_dtype_argument, files_by_label
from worker_process import WorkerProcess

from lmport.bench.machine import cpu_info, median_min_max, memory_bandwidth, write_result

PROMPT_TOKENS, DECODE_TOKENS = 256, 64
DEPTHS = (0, PROMPT_TOKENS)
THIS_CHECKOUT = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = Path("lmport") / "backends" / "cpu" / "csrc"

# Run by each worker in its checkout (``python -c``: the checkout's folder first on the path), the job as JSON in
# argv[1]: prints a JSON line once loaded and warm, then one a round for each line it reads.
WORKER = r'''
import json, os, sys, time
import torch
job = json.loads(sys.argv[1])
torch.set_num_threads(job["threads"])
import lmport
from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
engine = Engine(job["model"], EngineConfig(device_type="cpu", cache_max_entry_count=40,
                                           max_prefill_token_num=job["prompt_tokens"],
                                           kv_cache_dtype=job["kv_cache_dtype"]))
prompt = engine.tokenizer.encode("Paged attention keeps keys and values in fixed-size blocks. " * 40)
prompt = prompt[:job["prompt_tokens"]]

def step():
    # a request the engine ended with an error ends the worker: a round timed over a failure measures nothing
    for out in engine.step():
        if getattr(out, "error", None):
            sys.exit(f"the engine ended a request with an error: {out.error}")

def decode(depth):
    engine.add_request(prompt[:max(depth, 1)], GenerationConfig(max_new_tokens=1 + job["decode_tokens"],
                                                                ignore_eos=True))
    step()   # the prompt's step, not timed
    start = time.perf_counter()
    while engine.has_unfinished():
        step()
    return job["decode_tokens"] / (time.perf_counter() - start)

def prefill():
    engine.add_request(prompt, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        step()
    return len(prompt) / (time.perf_counter() - start)

prefill()   # warm-up: kernels built, caches touched
for depth in job["depths"]:
    decode(depth)
print(json.dumps({"lmport": os.path.dirname(os.path.abspath(lmport.__file__))}), flush=True)
for _ in sys.stdin:
    print(json.dumps({"prefill": prefill(), **{f"decode@{d}": decode(d) for d in job["depths"]}}), flush=True)
'''


def worker(checkout: Path, model: Path, threads: int, kv_cache_dtype: str) -> WorkerProcess:
    """A worker on ``checkout``'s code; refused if its lmport package is not that checkout's."""
    job = {"model": str(model), "threads": threads, "kv_cache_dtype": kv_cache_dtype,
           "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS, "depths": list(DEPTHS)}
    path = os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = WorkerProcess([sys.executable, "-c", WORKER, json.dumps(job)], dict(os.environ, PYTHONPATH=path),
                         cwd=checkout)
    if Path(proc.info["lmport"]) != checkout / "lmport":
        proc.close()
        raise SystemExit(f"{checkout}: its worker imported lmport from {proc.info['lmport']}, not the checkout's")
    return proc


def rounded(values: list[float], digits: int) -> dict:
    return {k: round(v, digits) for k, v in median_min_max(values).items()}


def summary(rounds: list[dict], a: str, b: str) -> dict:
    out = {}
    for key in ("prefill", *(f"decode@{d}" for d in DEPTHS)):
        out[key] = {a: rounded([r[a][key] for r in rounds], 1), b: rounded([r[b][key] for r in rounds], 1),
                    "B / A": rounded([r[b][key] / r[a][key] for r in rounds], 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="the other checkout (its code, and kernels built from its sources, as A)")
    ap.add_argument("--files", default="Q8_0,Q4_K_M", help=f"among {', '.join(TYPES)}, or paths of GGUF files")
    ap.add_argument("--files-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN, help="llama-quantize, for a missing file")
    ap.add_argument("--threads", type=int, default=2)
    add_kv_cache_dtype_argument(ap)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/kernel_ab.json")
    args = ap.parse_args()
    if args.base is None or not (args.base / KERNEL_SOURCES).is_dir():
        raise SystemExit(f"--base {args.base}: give a checkout of lmport (one with {KERNEL_SOURCES}), "
                         "e.g. from `git worktree add /tmp/base HEAD~1`")
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2 (each build leads every other round)")
    checkouts = {"A (base)": args.base.resolve(), "B (this checkout)": THIS_CHECKOUT}
    names = [f for f in args.files.split(",") if f]
    files = files_by_label(names, args.files_dir, args.llama_bin)
    results = {"machine": cpu_info(), "threads": args.threads, "isa": os.environ.get("LMPORT_CPU_ISA", "native"),
               "kv_cache_dtype": args.kv_cache_dtype,
               "checkouts": {k: str(v) for k, v in checkouts.items()}, "bandwidth": memory_bandwidth(args.threads),
               "files": {}}
    a, b = checkouts
    for label, path in files.items():
        workers = {side: worker(tree, path, args.threads, args.kv_cache_dtype) for side, tree in checkouts.items()}
        rounds = []
        for i in range(args.rounds):
            order = [a, b] if i % 2 == 0 else [b, a]
            rounds.append({side: workers[side].round() for side in order})
            print(f"{label} round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
        for w in workers.values():
            w.close()
        results["files"][label] = {"path": str(path), "rounds": rounds, "summary": summary(rounds, a, b),
                                   "lmport": {side: w.info["lmport"] for side, w in workers.items()}}
    results["bandwidth_after"] = memory_bandwidth(args.threads)
    print_table(results)
    write_result(args.out, results)


def print_table(results: dict) -> None:
    m = results["machine"]
    print(f"\n{m['model']}, {m['cores']} cores ({' '.join(m['kernel_flags'])}), kernels {results['isa']}, "
          f"{results['threads']} threads, K/V {results['kv_cache_dtype']}; "
          f"read bandwidth {results['bandwidth']['best_gbs']:.1f} GB/s "
          f"({results['bandwidth_after']['best_gbs']:.1f} after); A: {results['checkouts']['A (base)']}\n")
    print("| file | measure | A tok/s | B tok/s | B / A, per round |")
    print("|---|---|---:|---:|---:|")
    cell = lambda s, d: f"{s['median']:.{d}f} ({s['min']:.{d}f}-{s['max']:.{d}f})"   # noqa: E731
    for label, f in results["files"].items():
        for measure, s in f["summary"].items():
            print(f"| {label} | {measure} | {cell(s['A (base)'], 1)} | {cell(s['B (this checkout)'], 1)} | "
                  f"{cell(s['B / A'], 3)} |")


if __name__ == "__main__":
    main()
