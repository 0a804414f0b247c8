"""`lmport bench throughput`: offline batch throughput of one engine on a fixed mixed workload.

The workload (lmport.bench.datasets.workload): --requests requests with prompts of 8-256 tokens cut from a fixed
text and output lengths of 16, 32, 64 and 128 in turn (EOS ignored, so every request produces exactly its
tokens), fixed seed, all added at t=0 and run to the end by continuous batching. Each of --rounds rounds runs
the whole batch again on the same engine (after a warm-up request); the report gives the median (min-max) over
the rounds of output tokens/s, requests/s and the mean and p99 request latency.
"""
from __future__ import annotations

import argparse
import statistics
import time

from lmport.bench import machine
from lmport.bench.datasets import OUTPUT_LENGTHS, workload


def summarize(name: str, wall: float, latencies: list[float], requests) -> dict:
    """One run of ``requests`` (prompt, output tokens) in ``wall`` seconds, each done after its latency."""
    out_tokens = sum(n for _, n in requests)
    lat = sorted(latencies)
    return {
        "engine": name, "requests": len(requests), "wall_s": round(wall, 3),
        "requests_per_s": round(len(requests) / wall, 3), "output_tokens_per_s": round(out_tokens / wall, 1),
        "mean_latency_s": round(statistics.mean(lat), 3),
        "p99_latency_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
    }


def warm_up(engine) -> None:
    """A short request first: the first forward's one-off costs (kernel builds, allocations) are not measured."""
    from lmport.config import GenerationConfig
    engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_batch(engine, requests, name: str = "lmport") -> dict:
    """Every request added at once, then the engine stepped until all finish, each with its exact length."""
    from lmport.config import GenerationConfig
    preempted = engine.usage()["preemptions"]
    start = time.perf_counter()
    done = {}
    ids = [engine.add_request(prompt, GenerationConfig(max_new_tokens=n, ignore_eos=True)) for prompt, n in requests]
    wanted = dict(zip(ids, (n for _, n in requests)))
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"the engine ended a request with an error: {out.error}")
            if out.finished:
                if len(out.token_ids) != wanted[out.request_id]:
                    raise RuntimeError(f"request {out.request_id} ended after {len(out.token_ids)} of "
                                       f"{wanted[out.request_id]} tokens ({out.finish_reason})")
                done[out.request_id] = time.perf_counter() - start
    result = summarize(name, time.perf_counter() - start, list(done.values()), requests)
    result["preemptions"] = engine.usage()["preemptions"] - preempted
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2", help="smollm2, a local HF directory or a .gguf file")
    p.add_argument("--requests", type=int, default=64, help="requests in the batch (default 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="prompts of 8 to this many tokens (default 256)")
    p.add_argument("--output-lengths", type=int, nargs="+", default=list(OUTPUT_LENGTHS),
                   help=f"output tokens of the requests, in turn (default {' '.join(map(str, OUTPUT_LENGTHS))})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="times the batch is run (default 3)")


def check(args) -> None:
    if args.requests < 1 or args.rounds < 1:
        raise SystemExit("--requests and --rounds must be at least 1")
    if args.max_prompt_tokens < 8 or min(args.output_lengths) < 1:
        raise SystemExit("--max-prompt-tokens must be at least 8 and every --output-lengths at least 1")


def run(args, config) -> dict:
    import torch

    from lmport.engine.engine import Engine
    check(args)
    engine = Engine(args.model, config)
    try:
        requests = workload(engine.tokenizer, args.requests, args.seed, 8, args.max_prompt_tokens,
                            tuple(args.output_lengths))
        warm_up(engine)
        rounds = []
        for r in range(args.rounds):
            rounds.append(run_batch(engine, requests))
            print(f"round {r + 1}: {rounds[-1]['output_tokens_per_s']} output tok/s", flush=True)
        backend = engine.backend.capabilities.device_type
        weight_bytes = engine.weight_bytes
    finally:
        engine.close()
    keys = ("output_tokens_per_s", "requests_per_s", "mean_latency_s", "p99_latency_s", "wall_s")
    return {"benchmark": "throughput", "model": args.model, "backend": backend, "weight_bytes": weight_bytes,
            "config": machine.config_fields(config),
            "workload": {"requests": args.requests, "prompt_tokens": [8, args.max_prompt_tokens],
                         "output_lengths": args.output_lengths, "seed": args.seed,
                         "output_tokens": sum(n for _, n in requests)},
            "machine": machine.describe(torch.get_num_threads()), "torch_threads": torch.get_num_threads(),
            "rounds": rounds, "summary": {k: machine.median_min_max([r[k] for r in rounds]) for k in keys}}


def report(result: dict) -> str:
    s, w = result["summary"], result["workload"]
    cell = lambda k, f: f"{s[k]['median']:{f}} ({s[k]['min']:{f}}-{s[k]['max']:{f}})"   # noqa: E731
    return "\n".join([
        f"{result['model']} on {result['backend']}; {machine.line(result['machine'])}",
        f"{w['requests']} requests at once, prompts {w['prompt_tokens'][0]}-{w['prompt_tokens'][1]} tokens, outputs "
        f"{' '.join(map(str, w['output_lengths']))}; median (min-max) of {len(result['rounds'])} rounds", "",
        "| output tok/s | requests/s | mean latency (s) | p99 latency (s) |", "|---:|---:|---:|---:|",
        f"| {cell('output_tokens_per_s', '.1f')} | {cell('requests_per_s', '.3f')} | {cell('mean_latency_s', '.3f')} "
        f"| {cell('p99_latency_s', '.3f')} |"])
