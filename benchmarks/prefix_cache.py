"""Prefix caching on a shared-system-prompt workload: off, on (device only), on with the host tier.

Workload: K system prompts of L tokens each (a fixed text under a distinct
header), served in R rounds; in a round the prompts come one after another,
W requests each, every request with its own short question. A prompt's
requests share it, and each prompt comes back after the K-1 others: a device
cache too small for all K (the default --blocks) keeps losing them, the host
tier keeps them.

Requests are sent closed-loop, C in flight (the next is sent when one
finishes). TTFT = time of a request's first output token - time it was sent.
Every configuration gets the same device pool (--blocks blocks), so caching
off also shows what sharing saves in memory. Greedy decoding, EOS ignored;
outputs are compared with caching off.

Prints a markdown table, writes JSON (default benchmarks/results/prefix_cache.json).

    .venv/bin/python benchmarks/prefix_cache.py                 # default model, auto device
    .venv/bin/python benchmarks/prefix_cache.py --prompts 4 --rounds 2 --per-prompt 4 --prompt-len 1000
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections import deque
from lmport.bench.machine import write_result

TEXT = (
    "Follow these rules in every answer. Be accurate and say so when you are unsure. Prefer short, "
    "direct sentences. When a question involves arithmetic, show the steps. When it involves code, give "
    "a complete, runnable example and explain what each part does. Never invent references. If a request "
    "is ambiguous, state the interpretation you chose. Keep a friendly, professional tone. "
)


def workload(tokenizer, args) -> list[list[int]]:
    body = tokenizer.encode(TEXT * (args.prompt_len // 40 + 2))
    systems = []
    for k in range(args.prompts):
        header = tokenizer.encode(f"You are assistant number {k}, the expert on topic {k * 7 + 3}. ")
        systems.append((header + body)[:args.prompt_len])
    requests = []
    for _ in range(args.rounds):
        for k, system in enumerate(systems):
            for w in range(args.per_prompt):
                i = len(requests)
                question = tokenizer.encode(f" Question {i}: what is {i} times {k + w + 7}, and why?")
                requests.append(system + question)
    return requests


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(name: str, model: str, requests: list[list[int]], args, **config) -> tuple[dict, list[list[int]]]:
    import lmport
    from lmport import EngineConfig, GenerationConfig
    cfg = EngineConfig(device_type=args.device, cache_max_entry_count=args.blocks, block_size=args.block_size,
                       max_batch_size=args.concurrency, **config)
    pipe = lmport.pipeline(model, backend_config=cfg)
    engine = pipe.engine
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engine.add_request(list(range(10, 30)), GenerationConfig(max_new_tokens=2, ignore_eos=True))  # warm-up
    while engine.has_unfinished():
        engine.step()
    base = engine.usage()

    pending = deque(enumerate(requests))
    sent, ttft, outputs, cached = {}, {}, {}, {}
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(sent) - len(outputs) < args.concurrency:
            i, ids = pending.popleft()
            engine.add_request(ids, gen, request_id=str(i))
            sent[str(i)] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.token_ids and out.request_id not in ttft:
                ttft[out.request_id] = now - sent[out.request_id]
            if out.finished:
                assert out.finish_reason == "length", out
                outputs[out.request_id] = out.token_ids
                cached[out.request_id] = out.cached_tokens
    engine.backend.synchronize()
    wall = time.perf_counter() - start
    u = engine.usage()
    pipe.close()

    prompt_tokens = sum(map(len, requests))
    out_tokens = len(requests) * args.max_new_tokens
    lat = list(ttft.values())
    result = {
        "config": name, "requests": len(requests), "wall_s": round(wall, 2),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "total_tokens_per_s": round((prompt_tokens + out_tokens) / wall, 1),
        "ttft_mean_s": round(statistics.mean(lat), 3), "ttft_p50_s": round(percentile(lat, 0.5), 3),
        "ttft_p99_s": round(percentile(lat, 0.99), 3),
        "prompt_tokens": prompt_tokens, "cached_prompt_tokens": sum(cached.values()),
        "hit_rate": round(u["prefix_cache_hit_rate"], 3),
        "device_hit_rate": round(u["prefix_cache_device_hit_rate"], 3),
        "host_hit_rate": round(u["prefix_cache_host_hit_rate"], 3),
        "bytes_to_host": u["bytes_to_host"], "bytes_from_host": u["bytes_from_host"],
        "device_cache_evictions": u["device_cache_evictions"], "host_cache_evictions": u["host_cache_evictions"],
        "preemptions": u["preemptions"] - base["preemptions"],
        "preempt_swap": u["preempt_swap"], "preempt_recompute": u["preempt_recompute"],
        "device_blocks": u["blocks_total"], "host_blocks": u["host_blocks_total"],
    }
    return result, [outputs[str(i)] for i in range(len(requests))]


def table(results: list[dict]) -> str:
    cols = [("config", "config"), ("wall_s", "wall s"), ("output_tokens_per_s", "out tok/s"),
            ("total_tokens_per_s", "total tok/s"), ("ttft_mean_s", "TTFT mean s"), ("ttft_p50_s", "TTFT p50 s"),
            ("ttft_p99_s", "TTFT p99 s"), ("hit_rate", "hit rate"), ("device_hit_rate", "device hits"),
            ("host_hit_rate", "host hits"), ("bytes_to_host", "B to host"), ("bytes_from_host", "B from host"),
            ("preemptions", "preempt"), ("outputs_match_off", "same outputs")]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k, _ in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=4, help="K distinct system prompts")
    parser.add_argument("--prompt-len", type=int, default=1000, help="L tokens a system prompt")
    parser.add_argument("--per-prompt", type=int, default=4, help="W requests a prompt a round")
    parser.add_argument("--rounds", type=int, default=2, help="R rounds over the prompts")
    parser.add_argument("--concurrency", type=int, default=8, help="C requests in flight (and max_batch_size)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=None,
                        help="device KV blocks; default: room for about 2 of the K prompts plus the running requests")
    parser.add_argument("--host-gib", type=float, default=1.0)
    parser.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    args = parser.parse_args()

    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer(args.model)
    requests = workload(tokenizer, args)
    per_prompt_blocks = -(-args.prompt_len // args.block_size)
    if args.blocks is None:
        args.blocks = 2 * per_prompt_blocks + args.concurrency * 4
    configs = [("off", {}),
               ("on (device only)", {"enable_prefix_caching": True}),
               (f"on + host tier ({args.host_gib:g} GiB)", {"enable_prefix_caching": True,
                                                             "host_cache_gib": args.host_gib})]
    results, reference = [], None
    for name, config in configs:
        result, outputs = run(name, args.model, requests, args, **config)
        reference = reference or outputs
        result["outputs_match_off"] = outputs == reference
        results.append(result)
        print(f"{name}: {result['wall_s']} s", flush=True)

    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    report = {
        "benchmark": "prefix_cache", "model": args.model, "device": device, "torch": torch.__version__,
        "machine": platform.platform(), "cpu_threads": torch.get_num_threads(),
        "workload": {"system_prompts": args.prompts, "prompt_len": args.prompt_len, "per_prompt": args.per_prompt,
                     "rounds": args.rounds, "requests": len(requests), "concurrency": args.concurrency,
                     "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
                     "device_blocks": args.blocks, "host_cache_gib": args.host_gib,
                     "prompt_blocks": per_prompt_blocks},
        "results": results,
    }
    print(table(results))
    write_result(args.out, report)


if __name__ == "__main__":
    main()
