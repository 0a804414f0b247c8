"""Single-stream prefill and decode of lmport against llama.cpp on the same GGUF files, one run.

Files: the default model's shipped Q4_1 GGUF and a Q8_0 made from it with
`llama-quantize --allow-requantize IN OUT Q8_0` (cached beside this script's results).
Per file, with the same thread count on both sides (default 2), alternating engines for
--repeats rounds:

- prefill: 256 tokens. llama.cpp: `llama-bench -m FILE -p 256 -n 0 -t THREADS -r 1 -o json`; a
  prefill that crashes is retried with `-ub 1` and marked "(ubatch 1)" (see llama_bench below).
  lmport: one engine step of a 256-token prompt.
- decode: 128 tokens, at two context depths, because attention over the context is part of a
  decode step's cost (llama.cpp's own decode drops by about a fifth from depth 0 to 256 here):
  - depth 256, the 128 tokens that follow the 256-token prompt: llama.cpp `-p 0 -n 128 -d 256`;
    lmport generates them after the prompt above (EOS ignored).
  - depth 0, from an empty context: llama.cpp `-p 0 -n 128`; lmport generates them after a
    one-token prompt.
- lmport runs on the cpu backend with the weights kept quantized, and the float32 path (the GGUF
  dequantized at load, as before quantized weights) runs the prefill for comparison.

llama.cpp is not vendored: pass its bin directory (--llama-bin or LMPORT_LLAMA_CPP_BIN; default
/work/cache/llama.cpp/build/bin). The figures in docs/weight-quantization.md come from llama.cpp
as vendored in the llama-cpp-python sdist (`pip download --no-binary :all: llama-cpp-python`),
built with `cmake -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF` and the
AVX, AVX2, FMA, F16C, AVX512 and VNNI flags switched on by hand (a virtual machine may report AMX
yet fault on its tile instructions, which -DGGML_NATIVE=ON would use), targets llama-bench and
llama-quantize; the script prints `llama-bench --version`. The machine may be shared: both
engines run interleaved in one process tree so they see the same load, and every round is kept
in the JSON.

Run: python benchmarks/single_stream.py [--threads 2] [--repeats 3] [--out benchmarks/results/single_stream.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import psutil
import torch

DEFAULT_BIN = "/work/cache/llama.cpp/build/bin"
PROMPT_TOKENS, DECODE_TOKENS = 256, 128
DEPTHS = (0, PROMPT_TOKENS)   # context depths the decode is measured at
MEASURES = ("prefill", *(f"decode@{d}" for d in DEPTHS))


def llama_version(bin_dir: Path) -> str:
    out = subprocess.run([str(bin_dir / "llama-bench"), "--version"], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr).strip() else "?"


def make_q8_0(bin_dir: Path, source: Path, cache: Path) -> Path:
    target = cache / f"{source.stem.rsplit('.', 1)[0]}.Q8_0.gguf"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.stem}.partial.gguf")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), "Q8_0"],
                       check=True, capture_output=True)
        tmp.rename(target)
    return target


def _llama_bench_run(bin_dir: Path, model: Path, threads: int, prompt: int, gen: int, ubatch: int = 512,
                     depth: int = 0) -> float | None:
    """tok/s of one llama-bench test, None when it crashed."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(prompt), "-n", str(gen),
                          "-d", str(depth), "-t", str(threads), "-r", "1", "-ub", str(ubatch), "-o", "json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)[0]["avg_ts"]


def llama_bench(bin_dir: Path, model: Path, threads: int) -> dict:
    """Decode of 128 tokens at depths 0 and 256, and prefill of 256 tokens in ubatches of 512 (llama.cpp's
    default). Where the batched prefill crashes (the build on this machine faults in batched matmuls),
    the prefill is retried with ubatch 1 (token by token) and marked so: a lower bound, not llama.cpp's
    real prefill."""
    result = {f"decode@{d}": _llama_bench_run(bin_dir, model, threads, 0, DECODE_TOKENS, depth=d) for d in DEPTHS}
    prefill = _llama_bench_run(bin_dir, model, threads, PROMPT_TOKENS, 0)
    result["prefill_ubatch"] = 512
    if prefill is None:
        prefill, result["prefill_ubatch"] = _llama_bench_run(bin_dir, model, threads, PROMPT_TOKENS, 0, 1), 1
    result["prefill"] = prefill
    return result


class LmportRunner:
    def __init__(self, model: Path, weight_format: str):
        from lmport.config import EngineConfig
        from lmport.engine import Engine
        rss_before = psutil.Process().memory_info().rss
        # A fixed small cache: the RSS reported is the weights', not a share of free memory.
        self.engine = Engine(str(model), EngineConfig(device_type="cpu", cache_max_entry_count=40,
                                                      max_prefill_token_num=PROMPT_TOKENS,
                                                      weight_format=weight_format))
        self.rss_growth = psutil.Process().memory_info().rss - rss_before
        base = self.engine.tokenizer.encode("Paged attention keeps keys and values in fixed-size blocks. " * 40)
        self.prompt = base[:PROMPT_TOKENS]

    def run(self, decode: bool = True) -> dict:
        out = {"prefill": PROMPT_TOKENS / self._generate(self.prompt, 1)}
        if decode:
            for depth in DEPTHS:
                seconds = self._generate(self.prompt[:max(depth, 1)], 1 + DECODE_TOKENS, decode_only=True)
                out[f"decode@{depth}"] = DECODE_TOKENS / seconds
        return out

    def _generate(self, prompt: list[int], tokens: int, decode_only: bool = False) -> float:
        """Seconds to generate ``tokens`` after ``prompt`` (EOS ignored); with ``decode_only`` the first
        step, which runs the whole prompt and gives the first token, is left out."""
        from lmport.config import GenerationConfig
        e = self.engine
        e.add_request(prompt, GenerationConfig(max_new_tokens=tokens, ignore_eos=True))
        t0 = time.perf_counter()
        e.step()
        t1 = time.perf_counter()
        while e.has_unfinished():
            e.step()
        return time.perf_counter() - (t1 if decode_only else t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", default=os.environ.get("LMPORT_LLAMA_CPP_BIN", DEFAULT_BIN))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/single_stream.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bin_dir = Path(args.llama_bin)
    if not (bin_dir / "llama-bench").exists():
        raise SystemExit(f"no llama-bench in {bin_dir}: build llama.cpp (see this script's docstring) and pass "
                         f"--llama-bin or set LMPORT_LLAMA_CPP_BIN")
    from lmport.models.loader import cache_root, resolve_model_path
    q4_1 = resolve_model_path("smollm2")
    q8_0 = make_q8_0(bin_dir, q4_1, cache_root() / "benchmark-models")
    import gguf
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "load_average": os.getloadavg()},
               "threads": args.threads, "llama_cpp": {"bin": str(bin_dir), "version": llama_version(bin_dir)},
               "files": {}}
    for label, path in (("Q4_1", q4_1), ("Q8_0", q8_0)):
        quantized = LmportRunner(path, "auto")
        float32 = LmportRunner(path, "dequantize")
        quantized.run(), float32.run(decode=False)         # warm-up: kernels built, caches touched
        rounds = []
        for _ in range(args.repeats):
            rounds.append({"llama.cpp": llama_bench(bin_dir, path, args.threads),
                           "lmport": quantized.run(), "lmport float32": float32.run(decode=False)})
            print(f"{label} round {len(rounds)}: {json.dumps(rounds[-1])}", flush=True)
        gguf_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
        results["files"][label] = {
            "path": str(path), "gguf_tensor_bytes": gguf_bytes, "lmport_weight_bytes": quantized.engine.weight_bytes,
            "lmport_float32_weight_bytes": float32.engine.weight_bytes, "rounds": rounds,
            "median": {engine: {k: statistics.median(r[engine][k] for r in rounds) for k in MEASURES
                                if k in rounds[0][engine] and all(r[engine][k] is not None for r in rounds)}
                       for engine in rounds[0]}}
        quantized.engine.close(), float32.engine.close()
    results["load_average_after"] = os.getloadavg()
    print(f"llama.cpp: {results['llama_cpp']['version']} ({bin_dir}); threads {args.threads}; "
          f"load average before {results['machine']['load_average']}, after {results['load_average_after']}")
    print("\n| file | engine | prefill 256 tok/s | decode 128 @ depth 0 tok/s | decode 128 @ depth 256 tok/s "
          "| weight bytes |")
    print("|---|---|---:|---:|---:|---:|")
    for label, f in results["files"].items():
        for engine, m in f["median"].items():
            weights = {"llama.cpp": f["gguf_tensor_bytes"], "lmport": f["lmport_weight_bytes"],
                       "lmport float32": f["lmport_float32_weight_bytes"]}[engine]
            ubatch_1 = engine == "llama.cpp" and any(r[engine]["prefill_ubatch"] == 1 for r in f["rounds"])
            note = " (ubatch 1)" if ubatch_1 else ""
            decodes = " | ".join(f"{m.get(f'decode@{d}', float('nan')):.1f}" for d in DEPTHS)
            print(f"| {label} | {engine} | {m.get('prefill', float('nan')):.1f}{note} | {decodes} | {weights:,} |")
        ratios = {f"decode@{d}": f["median"]["lmport"][f"decode@{d}"] / f["median"]["llama.cpp"][f"decode@{d}"]
                  for d in DEPTHS}
        f["decode_ratio_lmport_over_llama_cpp"] = ratios
        print(f"| {label} | lmport / llama.cpp decode | | {' | '.join(f'{r:.2f}x' for r in ratios.values())} | |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
