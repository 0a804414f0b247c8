"""Single-stream decode on the cpu backend with a float32, an 8-bit and a 4-bit KV cache (quant_policy 0, 8, 4).

One engine a policy on the default model, all built first; each round decodes --tokens tokens after a
prompt of each --depths length with every policy in turn, so a load from elsewhere falls on all of them
alike. Prints decode tok/s, median (min-max) over --rounds rounds, each policy against policy 0, and
writes JSON.

    .venv/bin/python benchmarks/kv_quant_decode.py [--depths 1 256 1024] [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine import Engine
from machine import describe, line, spread, write_result

POLICIES = (0, 8, 4)


def decode_rate(engine: Engine, prompt: list[int], tokens: int) -> float:
    """Decode tok/s for ``tokens`` tokens after ``prompt`` (its prefill, which gives the first, left out)."""
    engine.add_request(prompt, GenerationConfig(max_new_tokens=tokens + 1, ignore_eos=True))
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 256, 1024])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/kv_quant_decode.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {p: Engine(args.model, EngineConfig(device_type="cpu", quant_policy=p, cache_max_entry_count=160,
                                                  max_prefill_token_num=max(args.depths)))
               for p in POLICIES}
    text = (Path(__file__).parent / "data" / "alice29.txt").read_text()
    prompt = engines[0].tokenizer.encode(text)
    rates = {(p, d): [] for p in POLICIES for d in args.depths}
    for p in POLICIES:   # warm-up
        decode_rate(engines[p], prompt[:8], 4)
    for _ in range(args.rounds):
        for d in args.depths:
            for p in POLICIES:
                rates[p, d].append(decode_rate(engines[p], prompt[:d], args.tokens))
    info = describe(args.threads)
    print(f"\n{args.model}, {args.threads} threads; decode tok/s of {args.tokens} tokens, median (min-max) of "
          f"{args.rounds} interleaved rounds; {line(info)}\n")
    print("| depth | " + " | ".join(f"quant_policy {p}" for p in POLICIES) + " | 8 / 0 | 4 / 0 |")
    print("|---:|" + "---|" * (len(POLICIES) + 2))
    for d in args.depths:
        med = {p: statistics.median(rates[p, d]) for p in POLICIES}
        print(f"| {d} | " + " | ".join(spread(rates[p, d], ".1f") for p in POLICIES)
              + f" | {med[8] / med[0]:.2f}x | {med[4] / med[0]:.2f}x |")
    write_result(Path(args.out), {"machine": info, "model": args.model, "threads": args.threads, "tokens": args.tokens,
                                  "rates": {f"policy {p}, depth {d}": r for (p, d), r in rates.items()}})


if __name__ == "__main__":
    main()
