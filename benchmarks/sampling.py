"""A sampled step's sampling on the cpu: lmport.worker.sampling.sample against transformers' logits warpers and
torch.multinomial, on the same logits, side by side.

--rows rows of a --vocab vocabulary (default 16 x 49152, SmolLM2 at concurrency 16), random logits with
the spread of a small model's; for each setting (temperature 1 alone, top-p, top-k, top-k with top-p,
min-p) both samplers draw one token a row, each row with its own generator (as a seeded request does in
either engine). Rounds interleave the two; medians (min-max) in ms. Prints a markdown table, writes JSON
(default benchmarks/results/sampling.json).

    .venv/bin/python benchmarks/sampling.py [--rows 16] [--vocab 49152] [--rounds 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from lmport.bench import machine

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"temperature 1": {}, "top_p 0.9": {"top_p": 0.9}, "top_k 40": {"top_k": 40},
            "top_k 50, top_p 0.95": {"top_k": 50, "top_p": 0.95}, "min_p 0.05": {"min_p": 0.05}}


def transformers_sample(logits: torch.Tensor, setting: dict, generators: list[torch.Generator]) -> list[int]:
    """What transformers' generate does for a sampled step: its warpers, then torch.multinomial a row."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(1.0)])
    if setting.get("top_k"):
        warpers.append(TopKLogitsWarper(setting["top_k"]))
    if setting.get("top_p"):
        warpers.append(TopPLogitsWarper(setting["top_p"]))
    if setting.get("min_p"):
        warpers.append(MinPLogitsWarper(setting["min_p"]))
    probs = warpers(torch.zeros(len(logits), 1, dtype=torch.long), logits).softmax(-1)
    return [int(torch.multinomial(probs[i], 1, generator=g)[0]) for i, g in enumerate(generators)]


def lmport_sample(logits: torch.Tensor, setting: dict, generators: list[torch.Generator]) -> list[int]:
    from lmport.config import GenerationConfig
    from lmport.worker.sampling import sample
    from lmport.sched.sequence import Sequence
    seqs = [Sequence(f"r{i}", [1], GenerationConfig(do_sample=True, **setting), frozenset(), generator=g)
            for i, g in enumerate(generators)]
    return sample(logits, seqs)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sampling.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 4
    samplers = {"lmport": lmport_sample, "transformers": transformers_sample}
    times: dict[str, dict[str, list[float]]] = {s: {n: [] for n in samplers} for s in SETTINGS}
    for _ in range(args.rounds + 1):   # the first round warms up and is dropped
        for setting, config in SETTINGS.items():
            for name, sampler in samplers.items():
                generators = [torch.Generator().manual_seed(i) for i in range(args.rows)]
                start = time.perf_counter()
                sampler(logits, config, generators)
                times[setting][name].append((time.perf_counter() - start) * 1000)
    info = machine.describe(args.threads)
    print(f"\nsampling {args.rows} rows x {args.vocab}, {args.rounds} rounds, {args.threads} threads; "
          f"{machine.line(info)}\n")
    print("| setting | lmport ms | transformers ms | transformers / lmport |\n|---|---:|---:|---:|")
    result = {}
    for setting, by_name in times.items():
        stats = {n: sorted(t[1:]) for n, t in by_name.items()}
        med = {n: statistics.median(t) for n, t in stats.items()}
        cells = [f"{med[n]:.2f} ({t[0]:.2f}-{t[-1]:.2f})" for n, t in stats.items()]
        print(f"| {setting} | {cells[0]} | {cells[1]} | {med['transformers'] / med['lmport']:.1f}x |")
        result[setting] = {n: {"median_ms": med[n], "min_ms": t[0], "max_ms": t[-1]} for n, t in stats.items()}
    machine.write_result(Path(args.out), {"results": result, "machine": info, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
