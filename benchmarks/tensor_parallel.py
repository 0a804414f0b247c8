"""Tensor parallelism on the cpu backend: tp=1 against tp=2 on one workload, side by side in one run.

Workload: --requests prompts (default 8) of about 40 tokens, --new-tokens greedy tokens each
(EOS ignored), all at once, float32, the default model. For tp=2 it also reports what rank 0's
collectives cost a step: calls, bytes and seconds inside all-reduce/gather (gloo).

Honest reading: on a machine with two cores, tp=2 splits the same two cores between two
processes (each rank gets one thread), so it cannot be faster than tp=1, and its
collectives add time; what tp buys is memory per device (the weights and KV cache of
one rank are half), which is what a model that does not fit one device needs.

Run: python benchmarks/tensor_parallel.py [--requests 8] [--new-tokens 32]
         [--out benchmarks/results/tensor_parallel.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import time

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.bench.machine import write_result


def run(model: str, tp: int, prompts: list[list[int]], new_tokens: int) -> dict:
    engine = Engine(model, EngineConfig(device_type="cpu", tp=tp, cache_max_entry_count=400,
                                        max_prefill_token_num=1024))
    try:
        gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        for p in prompts[:2]:   # warm-up: kernels compiled, threads started
            engine.add_request(p[:8], GenerationConfig(max_new_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        before = dict(engine.executor.runner.tp.stats)
        steps0 = engine.stats["steps"]
        start = time.perf_counter()
        for p in prompts:
            engine.add_request(p, gen)
        tokens = {}
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                first = first or time.perf_counter()
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        seconds = time.perf_counter() - start
        after = dict(engine.executor.runner.tp.stats)
        steps = engine.stats["steps"] - steps0
        return {
            "tp": tp, "seconds": seconds, "prefill_seconds": first - start,
            "tokens_per_second": len(prompts) * new_tokens / seconds, "steps": steps,
            "collective_calls_per_step": (after["calls"] - before["calls"]) / steps,
            "collective_bytes_per_step": (after["bytes"] - before["bytes"]) / steps,
            "collective_ms_per_step": 1000 * (after["seconds"] - before["seconds"]) / steps,
            "tokens": [tokens[k] for k in sorted(tokens, key=lambda r: int(r.split("-")[1]))[2:]],
        }
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3],
                        help="tp values (the default model's 9 heads allow 1, 3, 9; tiny models 1, 2, 4)")
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel.json")
    args = parser.parse_args()
    prompts = [[1] + list(range(500 + 31 * i, 540 + 31 * i)) for i in range(args.requests)]
    results = [run(args.model, tp, prompts, args.new_tokens) for tp in args.tp]
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    machine = {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
               "python": platform.python_version()}
    print(f"model {args.model}, {args.requests} requests x {args.new_tokens} tokens, float32, cpu backend, "
          f"{machine['cpus']} cores; greedy tokens identical across tp: {same}\n")
    print("| tp | total s | prefill s | tok/s | steps | collectives/step | bytes/step | ms in collectives/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['tp']} | {r['seconds']:.2f} | {r['prefill_seconds']:.2f} | {r['tokens_per_second']:.1f} | "
              f"{r['steps']} | {r['collective_calls_per_step']:.1f} | {r['collective_bytes_per_step']:,.0f} | "
              f"{r['collective_ms_per_step']:.2f} |")
    write_result(args.out, {"model": args.model, "machine": machine, "identical_tokens": same,
                            "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results]})


if __name__ == "__main__":
    main()
