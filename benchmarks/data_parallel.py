"""Data parallelism on a prefix-heavy workload: --dp 1, --dp 2 with prefix-affinity routing, --dp 2 round robin.

Workload: K long system prompts (a fixed text under a distinct header), N requests spread evenly over them in a
seeded random order, each with its own short question; sent closed-loop, C in flight. Every replica gets the
same KV pool (--blocks), sized so that one replica cannot hold all K prompts but each of two can hold its half:
prefix affinity should then keep the hit rate high, while round robin and a single replica keep evicting.
Greedy decoding, EOS ignored.

The three setups stay up for the whole run and take turns, round by round (>= 5 rounds); each round uses its own
system prompts, so every round starts with cold caches. Reported: medians with min-max over the rounds of
throughput (requests/s, generated tokens/s) and prefix-cache hit rate (all replicas, and each replica).

--dp 1 is one engine core in its own process behind an EngineClient, as `lmport serve` runs it; --dp 2 is two Ray
actors behind the front end of `lmport serve --dp 2` (lmport.dp.cluster), driven through the same generate()
calls, without HTTP. On a machine with fewer cores than replicas the replicas share the cores: throughput cannot
double, and the Ray and polling overhead shows; the hit rates are what routing changes.

Prints a markdown table, writes JSON (default benchmarks/results/data_parallel.json). Needs `lmport[ray]`.

    .venv/bin/python benchmarks/data_parallel.py                     # 8 prompts, 256 requests, smollm2
    .venv/bin/python benchmarks/data_parallel.py --model DIR --requests 64 --rounds 5
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import time
import uuid
from pathlib import Path

import torch

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.client import EngineClient
from lmport.engine.messages import EngineRequest
from lmport.models.loader import load_tokenizer
from lmport.bench.machine import spread, write_result

TEXT = ("Follow these rules in every answer. Be accurate and say so when you are unsure. Prefer short, direct "
        "sentences. When a question involves arithmetic, show the steps. Never invent references. ")


def workload(tokenizer, args, round_: int) -> list[list[int]]:
    body = tokenizer.encode(TEXT * (args.prompt_len // 30 + 2))
    systems = [(tokenizer.encode(f"Round {round_}. You are assistant {k}, the expert on topic {k * 7 + 3}. ")
                + body)[:args.prompt_len] for k in range(args.prompts)]
    requests = [systems[i % args.prompts] + tokenizer.encode(f" Question {i}: what is {i} times {i % 13 + 7}?")
                for i in range(args.requests)]
    # Shuffled (seeded): in a fixed cycle, round robin would send each prompt to the same replica every time.
    random.Random(round_).shuffle(requests)
    return requests


async def drive(loop, requests: list[list[int]], args) -> dict:
    """Closed loop, ``args.concurrency`` in flight; the outputs' token counts and the wall time."""
    gen = GenerationConfig(max_new_tokens=args.max_tokens, ignore_eos=True)
    pending = list(enumerate(requests))
    generated, errors = 0, 0

    async def worker():
        nonlocal generated, errors
        while pending:
            i, ids = pending.pop(0)
            async for out in loop.generate(EngineRequest(f"dp-bench-{i}-{uuid.uuid4().hex}", ids, gen)):
                if out.finished:
                    generated += len(out.token_ids)
                    errors += out.error is not None
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return {"seconds": time.perf_counter() - start, "generated": generated, "errors": errors}


def hit_rate(before: dict, after: dict) -> float:
    queried = after["prefix_cache_queried_blocks"] - before["prefix_cache_queried_blocks"]
    hits = (after["prefix_cache_hit_blocks_device"] + after["prefix_cache_hit_blocks_host"]
            - before["prefix_cache_hit_blocks_device"] - before["prefix_cache_hit_blocks_host"])
    return hits / queried if queried else 0.0


def usages(setup) -> list[dict]:
    kind, loop = setup
    if kind == "dp1":
        return [dict(loop.snapshot)]   # the core's usage after its last step
    return [s["usage"] for s in loop.status()]


def machine() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    x = torch.empty(64 * 2**20, dtype=torch.float32)   # 256 MiB, far past the caches
    y = torch.empty_like(x)
    best = min(_timed(lambda: y.copy_(x)) for _ in range(5))
    return {"cpu": model, "cores": os.cpu_count(), "flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")
                                                             if f in flags],
            "copy_bandwidth_gb_s": 2 * x.numel() * 4 / best / 1e9}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=8, help="distinct long system prompts (default 8)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens of each system prompt (default 512)")
    p.add_argument("--requests", type=int, default=256, help="requests a round (default 256)")
    p.add_argument("--max-tokens", type=int, default=16, help="generated tokens a request (default 16)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--blocks", type=int, default=None, help="KV blocks of each replica (default: room for 3/4 of "
                                                            "the system prompts: one replica cannot hold them all)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ray-address", default=None)
    p.add_argument("--out", default="benchmarks/results/data_parallel.json")
    args = p.parse_args()
    block_size = 16
    blocks = args.blocks or (args.prompts * args.prompt_len * 3 // 4) // block_size + args.concurrency * 4
    config = EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=blocks, block_size=block_size,
                          enable_prefix_caching=True, max_batch_size=args.concurrency, ray_address=args.ray_address)
    dp1 = EngineClient.start_process(args.model, config)   # forked before this process starts Ray's threads
    tokenizer = load_tokenizer(args.model)

    import ray  # pyright: ignore[reportMissingImports] - an optional extra; `make lint` runs without it

    from lmport.dp import cluster
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")   # see docs/distributed.md (shared machines)
    if args.ray_address is None:   # room for both dp2 setups' replicas, however few the cores
        ray.init(num_cpus=4, include_dashboard=False)
    setups = {"dp1": ("dp1", dp1),
              "dp2 prefix": ("dp2", cluster.start(args.model, config, 2, policy="prefix")),
              "dp2 round robin": ("dp2", cluster.start(args.model, config, 2, policy="round_robin"))}
    results: dict[str, list[dict]] = {name: [] for name in setups}
    try:
        for round_ in range(args.rounds):
            requests = workload(tokenizer, args, round_)
            for name, setup in setups.items():
                before = usages(setup)
                run = asyncio.run(drive(setup[1], requests, args))
                after = usages(setup)
                run["hit_rate"] = hit_rate(_sum(before), _sum(after))
                run["replica_hit_rates"] = [hit_rate(b, a) for b, a in zip(before, after)]
                results[name].append(run)
                print(f"round {round_} {name}: {run['seconds']:.1f} s, hit rate {run['hit_rate']:.2f} "
                      f"{[round(r, 2) for r in run['replica_hit_rates']]}", flush=True)
    finally:
        for _, loop in setups.values():
            loop.shutdown()
        ray.shutdown()

    host = machine()
    print(f"\n{host['cpu']}, {host['cores']} cores, {' '.join(host['flags'])}, copy bandwidth "
          f"{host['copy_bandwidth_gb_s']:.1f} GB/s; {args.prompts} system prompts x {args.prompt_len} tokens, "
          f"{args.requests} requests a round, {args.max_tokens} new tokens each, {args.concurrency} in flight, "
          f"{blocks} KV blocks a replica, {args.rounds} rounds; median (min-max)\n")
    print("| setup | requests/s | generated tokens/s | prefix hit rate | hit rate by replica | errors |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        per_replica = [spread([r["replica_hit_rates"][i] for r in runs])
                       for i in range(len(runs[0]["replica_hit_rates"]))]
        print(f"| {name} | {spread([args.requests / r['seconds'] for r in runs])} | "
              f"{spread([r['generated'] / r['seconds'] for r in runs])} | {spread([r['hit_rate'] for r in runs])} | "
              f"{', '.join(per_replica)} | {sum(r['errors'] for r in runs)} |")
    write_result(args.out, {"args": vars(args), "blocks": blocks, "machine": host, "results": results})


def _sum(usages_: list[dict]) -> dict:
    keys = ("prefix_cache_queried_blocks", "prefix_cache_hit_blocks_device", "prefix_cache_hit_blocks_host")
    return {k: sum(u.get(k, 0) for u in usages_) for k in keys}


if __name__ == "__main__":
    main()
