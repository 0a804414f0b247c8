"""Single-stream decode on the cpu backend with a float32, a float16, an 8-bit and a 4-bit KV cache
(quant_policy 0; kv_cache_dtype="float16"; quant_policy 8, 4).

One engine a cache on the default model, all built first; each round decodes --tokens tokens after a
prompt of each --depths length with every cache in turn, so a load from elsewhere falls on all of them
alike. Prints decode tok/s, median (min-max) over --rounds rounds, each cache against the float32 one
(the ratio of the medians), and writes JSON.

    .venv/bin/python benchmarks/kv_quant_decode.py [--depths 1 256 1024] [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.bench.machine import describe, line, spread, write_result

# Each cache: its EngineConfig fields.
CACHES = {"float32": {}, "float16": {"kv_cache_dtype": "float16"}, "int8": {"quant_policy": 8},
          "int4": {"quant_policy": 4}}


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
    engines = {c: Engine(args.model, EngineConfig(device_type="cpu", cache_max_entry_count=160,
                                                  max_prefill_token_num=max(args.depths), **fields))
               for c, fields in CACHES.items()}
    text = (Path(__file__).parent / "data" / "alice29.txt").read_text()
    prompt = engines["float32"].tokenizer.encode(text)
    rates = {(c, d): [] for c in CACHES for d in args.depths}
    for c in CACHES:   # warm-up
        decode_rate(engines[c], prompt[:8], 4)
    for _ in range(args.rounds):
        for d in args.depths:
            for c in CACHES:
                rates[c, d].append(decode_rate(engines[c], prompt[:d], args.tokens))
    info = describe(args.threads)
    print(f"\n{args.model}, {args.threads} threads; decode tok/s of {args.tokens} tokens, median (min-max) of "
          f"{args.rounds} interleaved rounds; {line(info)}\n")
    others = [c for c in CACHES if c != "float32"]
    print("| depth | " + " | ".join(CACHES) + " | " + " | ".join(f"{c} / float32" for c in others) + " |")
    print("|---:|" + "---|" * (len(CACHES) + len(others)))
    for d in args.depths:
        med = {c: statistics.median(rates[c, d]) for c in CACHES}
        print(f"| {d} | " + " | ".join(spread(rates[c, d], ".1f") for c in CACHES) + " | "
              + " | ".join(f"{med[c] / med['float32']:.2f}x" for c in others) + " |")
    write_result(Path(args.out), {"machine": info, "model": args.model, "threads": args.threads, "tokens": args.tokens,
                                  "caches": CACHES,
                                  "rates": {f"{c} cache, depth {d}": r for (c, d), r in rates.items()}})


if __name__ == "__main__":
    main()
