"""Single-stream prefill and decode of lmport against llama.cpp on the same GGUF files, in one run.

Files: the default model as shipped (Q4_1) and requantized by llama.cpp to Q8_0 and Q4_K_M
(benchmarks/gguf_files.py: `llama-quantize --allow-requantize`, made once when missing). Per file,
with the same thread count on both sides (default 2), the engines take turns for --repeats rounds
(default 5), so a load from elsewhere falls on all of them alike; the table gives the median and the
min-max of the rounds, and every round is kept in the JSON.

- prefill: 256 tokens (--prompt-tokens). llama.cpp: `llama-bench -p 256 -n 0`; lmport: one engine step of the
  prompt.
- decode: 128 tokens (--decode-tokens) at each context depth of --depths, default 0 and 256 (llama-bench
  `-n 128 -d 256`; lmport after a prompt of that many tokens, one at depth 0): attention over the context is
  part of a decode step.
- lmport twice: its kernels built for this CPU (AVX-512 where it has it) and with LMPORT_CPU_ISA=avx2
  (the AVX2 path a CPU without AVX-512 runs). Each runs in a worker process of its own, kept across
  rounds. Its K/V cache is float16 (--kv-cache-dtype), as llama.cpp keeps its own by default.
- With --llama-avx2-bin, llama.cpp a second time, built without AVX-512 (as a CPU without it builds it
  natively: ``-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_BMI2=ON``): the AVX2 path's peer, the ratio a user of such a CPU sees.
- The memory read bandwidth is measured in the same run with the same threads (lmport/bench/machine.py); a
  decode step reads every weight once, so bandwidth / weight bytes is the fastest decode can be
  (the "limit" row). Where a step reads less than the file (a mixture of experts reads the experts it routes to;
  a separate output projection leaves the embedding table unread but a row), a "step byte limit" row too.
- The ratios: of the medians, and the median (min-max) of each round's own ratio ("round by round").

llama.cpp, as its users build it: `cmake -B build -DGGML_NATIVE=ON && cmake --build build --config
Release --target llama-bench llama-quantize` (its README's build). Either pass the bin directory of
such a build (--llama-bin, or LMPORT_LLAMA_CPP_BIN; default ~/.cache/llamacpp/build/bin), or pass its
source (--llama-src, e.g. the llama.cpp vendored in the llama-cpp-python sdist) and the script builds
it so. A virtual machine may report AMX and fault on its tile instructions, which GGML_NATIVE=ON
would then use: there, pass --llama-cmake-args "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" (the flags this CPU has, without AMX).

Run: python benchmarks/single_stream.py [--threads 2] [--repeats 5] [--files Q4_1,Q8_0,Q4_K_M]
(--files also takes paths of other GGUF files, e.g. a random-weight model of another architecture's shapes)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from gguf_files import DEFAULT_DIR, DEFAULT_LLAMA_BIN, TYPES, add_kv_cache_dtype_argument, check_paths, files_by_label
from lmport.bench.machine import cpu_info, median_min_max, memory_bandwidth, write_result
from worker_process import WorkerProcess, step

PROMPT_TOKENS, DECODE_TOKENS, DEPTHS = 256, 128, (0, 256)
DEFAULT_LENGTHS = {"prompt": PROMPT_TOKENS, "decode": DECODE_TOKENS, "depths": list(DEPTHS)}
NATIVE_CMAKE_ARGS = "-DGGML_NATIVE=ON"
# lmport's kernel paths: the environment each worker runs under
LMPORT_PATHS = {"lmport": {"LMPORT_CPU_ISA": "native"}, "lmport avx2": {"LMPORT_CPU_ISA": "avx2"},
                "lmport exact prefill": {"LMPORT_CPU_ISA": "native", "LMPORT_CPU_PREFILL": "exact"},
                "lmport bf16 prefill": {"LMPORT_CPU_ISA": "native", "LMPORT_CPU_PREFILL": "bf16"}}
AVX2_PEER = "llama.cpp avx2"   # llama.cpp without AVX-512 (--llama-avx2-bin): the peer of lmport's AVX2 path


# ---- llama.cpp ----

def build_llama(src: Path, cmake_args: str) -> Path:
    """llama-bench and llama-quantize built from ``src`` into src/build-lmport-bench (reused when there)."""
    build = src / "build-lmport-bench"
    if not (build / "bin" / "llama-bench").exists():
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *cmake_args.split()],
                       check=True)
        subprocess.run(["cmake", "--build", str(build), "--config", "Release", "-j", str(os.cpu_count() or 1),
                        "--target", "llama-bench", "llama-quantize"], check=True)
    return build / "bin"


def llama_version(bin_dir: Path) -> str:
    out = subprocess.run([str(bin_dir / "llama-bench"), "--version"], capture_output=True, text=True)
    text = (out.stdout + out.stderr).strip()
    return " ".join(text.splitlines()[:2]) if text else "?"


def llama_bench(bin_dir: Path, model: Path, threads: int, prompt: int, gen: int, depth: int = 0) -> dict:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(prompt), "-n", str(gen),
                          "-d", str(depth), "-t", str(threads), "-r", "1", "-o", "json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"llama-bench failed on {model.name}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)[0]


def measures(lengths: dict) -> tuple[str, ...]:
    return (*(("prefill",) if lengths["prompt"] else ()), *(f"decode@{d}" for d in lengths["depths"]))


def llama_round(bin_dir: Path, model: Path, threads: int, lengths: dict) -> dict:
    runs = {f"decode@{d}": llama_bench(bin_dir, model, threads, 0, lengths["decode"], d) for d in lengths["depths"]}
    if lengths["prompt"]:
        runs["prefill"] = llama_bench(bin_dir, model, threads, lengths["prompt"], 0)
    out = {k: r["avg_ts"] for k, r in runs.items()}
    out["threads"] = next(iter(runs.values()))["n_threads"]
    return out


# ---- lmport, one worker process per kernel path ----

def lmport_worker(model: Path, env: dict, threads: int, kv_cache_dtype: str, lengths: dict) -> WorkerProcess:
    """This script run as ``--worker FILE`` with ``env`` (a kernel path's) added: one engine, a round per request."""
    return WorkerProcess([sys.executable, __file__, "--worker", str(model), "--threads", str(threads),
                          "--kv-cache-dtype", kv_cache_dtype, "--prompt-tokens", str(lengths["prompt"]),
                          "--decode-tokens", str(lengths["decode"]), "--depths", ",".join(map(str, lengths["depths"]))],
                         dict(os.environ, **env))


def worker_main(model: str, threads: int, kv_cache_dtype: str, lengths: dict) -> None:
    torch.set_num_threads(threads)
    from lmport.backends.cpu import kernels
    from lmport.config import EngineConfig, GenerationConfig
    from lmport.engine.engine import Engine
    longest = max(1, lengths["prompt"], *lengths["depths"])
    blocks = max(40, (longest + lengths["decode"]) // 16 + 2)   # blocks of the cpu backend's 16 tokens
    engine = Engine(model, EngineConfig(device_type="cpu", cache_max_entry_count=blocks, max_prefill_token_num=longest,
                                        kv_cache_dtype=kv_cache_dtype))
    text = "Paged attention keeps keys and values in fixed-size blocks. " * (longest // 8 + 1)
    prompt = engine.tokenizer.encode(text)[:longest]

    def generate(tokens: list[int], new: int, decode_only: bool) -> float:
        """Seconds to generate ``new`` tokens after ``tokens`` (EOS ignored); with ``decode_only`` the
        first step (the prompt's prefill, which gives the first token) left out."""
        engine.add_request(tokens, GenerationConfig(max_new_tokens=new, ignore_eos=True))
        t0 = time.perf_counter()
        step(engine)
        t1 = time.perf_counter()
        while engine.has_unfinished():
            step(engine)
        return time.perf_counter() - (t1 if decode_only else t0)

    def one_round() -> dict:
        out = {}
        if lengths["prompt"]:
            out["prefill"] = lengths["prompt"] / generate(prompt[:lengths["prompt"]], 1, False)
        for depth in lengths["depths"]:
            out[f"decode@{depth}"] = lengths["decode"] / generate(prompt[:max(depth, 1)], 1 + lengths["decode"], True)
        out["threads"] = torch.get_num_threads()
        return out

    compiled = kernels.load()
    one_round()   # warm-up: kernels built, caches touched
    print(json.dumps({"weight_bytes": engine.weight_bytes, "kernels": None if compiled is None else compiled.__name__,
                      "isa": os.environ.get("LMPORT_CPU_ISA", "native"),
                      "prefill": kernels.prefill_precision()}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(one_round()), flush=True)


# ---- the run ----

def tensor_bytes(path: Path) -> tuple[int, int]:
    """(the file's tensor bytes, the bytes a decode step reads of them): a mixture-of-experts file's stacked
    experts (``*_exps``) counted at the share a token routes to (expert_used_count of expert_count), and the
    embedding table left out where the output projection is a tensor of its own (a step reads one row of it)."""
    import gguf
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    used, count = (reader.fields.get(f"{arch}.{key}") for key in ("expert_used_count", "expert_count"))
    share = used.contents() / count.contents() if used is not None and count is not None else 1.0
    total = sum(int(t.n_bytes) for t in reader.tensors)
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    names = {t.name: int(t.n_bytes) for t in reader.tensors}
    embedding = names.get("token_embd.weight", 0) if "output.weight" in names else 0
    return total, round(total - experts * (1 - share) - embedding)


def summary(rounds: list[dict], engine: str, lengths: dict) -> dict:
    return {k: median_min_max([r[engine][k] for r in rounds]) for k in measures(lengths)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN)
    ap.add_argument("--llama-src", type=Path, help="build llama.cpp from this source tree instead of --llama-bin")
    ap.add_argument("--llama-cmake-args", default=NATIVE_CMAKE_ARGS,
                    help="cmake flags for --llama-src (a VM that misreports AMX: name the ISA flags, see above)")
    ap.add_argument("--llama-avx2-bin", type=Path,
                    help="the bin directory of a llama.cpp built without AVX-512: the AVX2 path's peer")
    ap.add_argument("--files", default=",".join(TYPES), help=f"among {', '.join(TYPES)}, or paths of GGUF files")
    ap.add_argument("--files-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--paths", default=",".join(LMPORT_PATHS), help=f"lmport's kernel paths: {', '.join(LMPORT_PATHS)}")
    ap.add_argument("--threads", type=int, default=2)
    add_kv_cache_dtype_argument(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                    help="the prefill's prompt length (0: no prefill measured)")
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="tokens decoded at each depth")
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="context depths of the decode runs")
    ap.add_argument("--out", default="benchmarks/results/single_stream.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = {"prompt": args.prompt_tokens, "decode": args.decode_tokens,
               "depths": [int(d) for d in args.depths.split(",") if d]}
    if args.worker:
        return worker_main(args.worker, args.threads, args.kv_cache_dtype, lengths)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.prompt_tokens < 0 or not (args.prompt_tokens or lengths["depths"]):
        raise SystemExit("--prompt-tokens must be 0 or more, and with 0 --depths must name at least one depth")
    names = [f for f in args.files.split(",") if f]
    check_paths(names)   # before llama.cpp is built or anything measured
    bin_dir = build_llama(args.llama_src, args.llama_cmake_args) if args.llama_src else Path(args.llama_bin)
    if not (bin_dir / "llama-bench").exists():
        raise SystemExit(f"no llama-bench in {bin_dir}: pass --llama-bin (a llama.cpp build's bin directory) or "
                         f"--llama-src (its source, built here with {NATIVE_CMAKE_ARGS})")
    peers = {"llama.cpp": bin_dir}
    if args.llama_avx2_bin:
        if not (args.llama_avx2_bin / "llama-bench").exists():
            raise SystemExit(f"--llama-avx2-bin: no llama-bench in {args.llama_avx2_bin}")
        peers[AVX2_PEER] = args.llama_avx2_bin
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(LMPORT_PATHS)
    if unknown:
        raise SystemExit(f"unknown --paths {sorted(unknown)}: among {', '.join(LMPORT_PATHS)}")
    # label -> the GGUF file (a type of the default model's made with llama-quantize where missing)
    files = files_by_label(names, args.files_dir, bin_dir)
    cmake_args = args.llama_cmake_args if args.llama_src else "as built (see its CMakeCache)"
    results = {"machine": cpu_info(), "threads": args.threads, "repeats": args.repeats, "lengths": lengths,
               "kv_cache_dtype": args.kv_cache_dtype,
               "llama_cpp": {"bin": str(bin_dir), "version": llama_version(bin_dir), "cmake_args": cmake_args},
               "peers": {name: {"bin": str(b), "version": llama_version(b)} for name, b in peers.items()},
               "bandwidth": memory_bandwidth(args.threads), "files": {}}
    for label, path in files.items():
        workers = {name: lmport_worker(path, LMPORT_PATHS[name], args.threads, args.kv_cache_dtype, lengths)
                   for name in paths}
        rounds = []
        for _ in range(args.repeats):
            rounds.append({**{name: llama_round(b, path, args.threads, lengths) for name, b in peers.items()},
                           **{name: w.round() for name, w in workers.items()}})
            print(f"{label} round {len(rounds)}: {json.dumps(rounds[-1])}", flush=True)
        file_bytes, step_bytes = tensor_bytes(path)
        results["files"][label] = {
            "path": str(path), "gguf_tensor_bytes": file_bytes, "step_tensor_bytes": step_bytes, "rounds": rounds,
            "lmport": {name: w.info for name, w in workers.items()},
            "summary": {engine: summary(rounds, engine, lengths) for engine in rounds[0]}}
        for w in workers.values():
            w.close()
    results["bandwidth_after"] = memory_bandwidth(args.threads)
    results["load_average_after"] = os.getloadavg()
    print_table(results)
    write_result(args.out, results)


def print_table(results: dict) -> None:
    m, bw = results["machine"], results["bandwidth"]
    gbs = bw["best_gbs"]
    print(f"\n{m['model']}, {m['cores']} cores ({' '.join(m['kernel_flags'])}); load average {m['load_average']} "
          f"before, {results['load_average_after']} after")
    print(f"llama.cpp {results['llama_cpp']['version']} ({results['llama_cpp']['bin']}, "
          f"cmake {results['llama_cpp']['cmake_args']})")
    if AVX2_PEER in results["peers"]:
        print(f"{AVX2_PEER}: {results['peers'][AVX2_PEER]['version']} ({results['peers'][AVX2_PEER]['bin']})")
    print(f"read bandwidth {gbs:.1f} GB/s ({results['bandwidth_after']['best_gbs']:.1f} after; "
          f"{bw['method']}, {bw['threads']} threads); lmport's K/V cache {results.get('kv_cache_dtype', 'float32')}; "
          f"medians of {results['repeats']} interleaved rounds, min-max\n")
    lengths = results.get("lengths", DEFAULT_LENGTHS)
    keys = measures(lengths)
    heads = [*([f"prefill {lengths['prompt']} tok/s"] if lengths["prompt"] else []),
             *(f"decode @{d} tok/s" for d in lengths["depths"])]
    prefill_cell = " |" if lengths["prompt"] else ""   # the prefill column's empty cell in the decode-only rows
    print(f"| file | engine | threads | {' | '.join(heads)} | weight bytes |")
    print(f"|---|---|---:|{'---:|' * len(heads)}---:|")
    cell = lambda s: f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"   # noqa: E731
    ratio_cell = lambda s: f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"   # noqa: E731
    for label, f in results["files"].items():
        for engine, s in f["summary"].items():
            weights = f["gguf_tensor_bytes"] if engine in results["peers"] else f["lmport"][engine]["weight_bytes"]
            threads = f["rounds"][0][engine]["threads"]
            print(f"| {label} | {engine} | {threads} | {' | '.join(cell(s[k]) for k in keys)} | {weights:,} |")
        limit = gbs * 1e9 / f["gguf_tensor_bytes"]
        print(f"| {label} | byte limit (bandwidth / file bytes) | |{prefill_cell}"
              f"{f' {limit:.1f} |' * len(lengths['depths'])} |")
        if f.get("step_tensor_bytes", f["gguf_tensor_bytes"]) != f["gguf_tensor_bytes"]:
            step_limit = gbs * 1e9 / f["step_tensor_bytes"]
            print(f"| {label} | step byte limit (bandwidth / the {f['step_tensor_bytes']:,} bytes a token reads) "
                  f"| |{prefill_cell}"
                  f"{f' {step_limit:.1f} |' * len(lengths['depths'])} |")
        for engine in f["summary"]:
            shares = [f["summary"][engine][f"decode@{d}"]["median"] / limit for d in lengths["depths"]]
            print(f"| {label} | {engine}, decode / byte limit | |{prefill_cell}"
                  f"{''.join(f' {100 * x:.0f}% |' for x in shares)} |")
        ratios, per_round = {}, {}
        pairs = [(engine, "llama.cpp") for engine in f["summary"] if engine not in results["peers"]]
        if AVX2_PEER in f["summary"] and "lmport avx2" in f["summary"]:
            pairs.append(("lmport avx2", AVX2_PEER))
        for engine, peer in pairs:
            name = engine if peer == "llama.cpp" else f"{engine} / {peer}"
            r = ratios[name] = {k: f["summary"][engine][k]["median"] / f["summary"][peer][k]["median"] for k in keys}
            print(f"| {label} | {engine} / {peer} | | {' | '.join(f'{r[k]:.2f}x' for k in keys)} | |")
        # Each round's ratio too: the engines' runs of a round follow one another, so the memory bandwidth a
        # shared host gives, which drifts over the run, meets them more alike than it meets the medians.
        for engine, peer in pairs:
            name = engine if peer == "llama.cpp" else f"{engine} / {peer}"
            r = per_round[name] = {k: median_min_max([rnd[engine][k] / rnd[peer][k] for rnd in f["rounds"]])
                                   for k in keys}
            print(f"| {label} | {engine} / {peer}, round by round | | {' | '.join(ratio_cell(r[k]) for k in keys)} | |")
        f["ratios_over_llama_cpp"] = ratios
        f["ratios_round_by_round"] = per_round
        f["byte_limit_tok_s"] = limit


if __name__ == "__main__":
    main()
