"""Prefill through the engine with its GEMMs on oneDNN (the cpu backend's choice) against MKL, in one process.

Per GGUF file of the default model (benchmarks/gguf_files.py), one engine is built and a 256-token prompt
is prefilled (one engine step, the first token included) --rounds times with ``prefill_gemm`` on oneDNN
and on ``F.linear`` (MKL) in turn, so both see the same machine; the first round of each is a warm-up and
left out. Prints median (min-max) tok/s and the ratio, writes JSON.

    .venv/bin/python benchmarks/prefill_gemm.py [--files Q4_1,Q8_0,Q4_K_M] [--rounds 9] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import lmport.backends.cpu as cpu
from gguf_files import TYPES, gguf_file
from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.bench.machine import describe, line, spread, write_result

PROMPT_TOKENS = 256


def prefill_rates(kind: str, rounds: int) -> dict[str, list[float]]:
    engine = Engine(str(gguf_file(kind)), EngineConfig(device_type="cpu", cache_max_entry_count=40,
                                                       max_prefill_token_num=PROMPT_TOKENS))
    prompt = engine.tokenizer.encode("Paged attention keeps keys and values in fixed-size blocks. " * 40)
    prompt = prompt[:PROMPT_TOKENS]
    onednn, rates = cpu.onednn_linear(), {"oneDNN": [], "MKL": []}
    try:
        for _ in range(rounds):
            for name, op in (("oneDNN", onednn), ("MKL", None)):
                cpu.onednn_linear = lambda op=op: op
                engine.add_request(prompt, GenerationConfig(max_new_tokens=1, ignore_eos=True))
                start = time.perf_counter()
                engine.step()
                rates[name].append(PROMPT_TOKENS / (time.perf_counter() - start))
                while engine.has_unfinished():
                    engine.step()
    finally:
        cpu.onednn_linear = lambda: onednn
    return {name: r[1:] for name, r in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default=",".join(TYPES))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/prefill_gemm.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu.onednn_linear() is None:
        raise SystemExit("this torch has no oneDNN linear: prefill runs on F.linear already")
    results = {kind: prefill_rates(kind, args.rounds) for kind in args.files.split(",")}
    info = describe(args.threads)
    print(f"\nprefill of {PROMPT_TOKENS} tokens, tok/s, median (min-max) of {args.rounds - 1} interleaved rounds, "
          f"{args.threads} threads; {line(info)}\n")
    print("| file | oneDNN | MKL | oneDNN / MKL |\n|---|---|---|---|")
    for kind, r in results.items():
        ratio = statistics.median(r["oneDNN"]) / statistics.median(r["MKL"])
        print(f"| {kind} | {spread(r['oneDNN'], '.1f')} | {spread(r['MKL'], '.1f')} | {ratio:.2f}x |")
    write_result(Path(args.out), {"machine": info, "threads": args.threads, "rounds": results})


if __name__ == "__main__":
    main()
