"""guidellm's concurrency profile through an Engine in this process: no HTTP, and no client sharing the cores.

--concurrency requests at a time (default 16), --requests in all (64), each of --prompt-tokens random token
ids (128; a round's prompts are its own, so no round finds another's in the prefix cache) and
--output-tokens tokens (64, EOS ignored), sampled at temperature 1 as guidellm's requests are (greedy with
--greedy); a new request is added as one finishes. The engine is configured as `lmport serve` configures
it (prefix caching on, decode_prefill_tokens 128). Reports output tok/s, the median step and the time
`lmport.worker.model_step.sample_each` (a step's sampling) takes a call, median (min-max) over --rounds rounds.
Prints a markdown table, writes JSON (default benchmarks/results/concurrent_engine.json).

    .venv/bin/python benchmarks/concurrent_engine.py [--concurrency 16] [--requests 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from lmport.bench import machine

ROOT = Path(__file__).resolve().parents[1]


def one_round(engine, prompts: list[list[int]], concurrency: int, config) -> dict:
    """The prompts through ``engine``, ``concurrency`` at a time; tok/s, step times and _sample's times."""
    from lmport.worker import model_step
    sample_times: list[float] = []
    sample = model_step.sample_each

    def timed_sample(*args, **kwargs):
        start = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            sample_times.append(time.perf_counter() - start)

    model_step.sample_each = timed_sample
    waiting = iter(enumerate(prompts))
    start = time.perf_counter()

    def add_next() -> None:
        if (item := next(waiting, None)) is not None:
            engine.add_request(item[1], config, request_id=f"c{start}-{item[0]}")

    for _ in range(concurrency):
        add_next()
    tokens, steps = 0, []
    while engine.has_unfinished():
        t = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        for out in outputs:
            tokens += len(out.delta_token_ids)
            if out.finished:
                add_next()
    wall = time.perf_counter() - start
    model_step.sample_each = sample
    return {"output_tokens_per_s": tokens / wall, "wall_s": wall, "steps": len(steps),
            "step_median_ms": statistics.median(steps) * 1e3,
            "sample_median_ms": statistics.median(sample_times) * 1e3 if sample_times else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "concurrent_engine.json"))
    args = p.parse_args()

    from lmport import EngineConfig, GenerationConfig
    from lmport.config import SERVE_DECODE_PREFILL_TOKENS
    from lmport.engine.engine import Engine
    torch.set_num_threads(args.threads)
    engine = Engine(args.model, EngineConfig(device_type="cpu", enable_prefix_caching=True,
                                             decode_prefill_tokens=SERVE_DECODE_PREFILL_TOKENS))
    config = GenerationConfig(max_new_tokens=args.output_tokens, ignore_eos=True, do_sample=not args.greedy)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]

    one_round(engine, prompts(2, 8), 2, config)   # warm-up: first forwards, allocators
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(engine, prompts(args.requests, args.prompt_tokens), args.concurrency, config))
        print(f"round {i + 1}: {rounds[-1]['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    engine.close()

    info = machine.describe(args.threads)
    print(f"\n{args.requests} requests, {args.concurrency} at a time, {args.prompt_tokens} prompt tokens, "
          f"{args.output_tokens} {'greedy' if args.greedy else 'sampled'} tokens each, {args.threads} threads; "
          f"{machine.line(info)}\n")
    print("| metric | median (min-max) |\n|---|---|")
    for key, name in (("output_tokens_per_s", "output tok/s"), ("step_median_ms", "step ms (median of a round)"),
                      ("sample_median_ms", "sampling ms a call (median of a round)")):
        print(f"| {name} | {machine.spread([r[key] for r in rounds], '.2f')} |")
    machine.write_result(Path(args.out), {"args": vars(args), "rounds": rounds, "machine": info})
    return 0


if __name__ == "__main__":
    sys.exit(main())
