"""The cpu backend's paged attention with sinks and chunks: its compiled kernel against the reference op.

One decode step's attention over every layer of a released model's shape, at a few context depths: gpt-oss-20b
(24 layers, 64 query heads and 8 KV heads of 64, sinks on every layer, 128-token sliding windows on every other)
and Llama 4 Scout (48 layers, 40 query heads and 8 KV heads of 128, chunks of 8192 on three layers of four, the
fourth global). Random q, caches and sinks (the data comes from memory, as in a step); the kernel's output is
checked against the reference op's before timing. The two take turns round by round (order alternating), so a
shared host's drift falls on both alike; each is reported as its median (min-max) over the rounds.

Run: python benchmarks/attention_variants_speed.py [--rounds 7] [--depths 256,2048] [--cache float16]
"""
from __future__ import annotations

import argparse
import time

import torch

from lmport import ops
from lmport.backends.cpu import CpuBackend, kernels
from lmport.bench.machine import cpu_info, median_min_max, spread, write_result
from lmport.kv.layout import KVLayout

BLOCK_SIZE = 16
# name: (layers, query heads, KV heads, head dim, each layer's (window, chunk), sinks)
MODELS = {
    "gpt-oss-20b": (24, 64, 8, 64, [(128 if i % 2 == 0 else None, None) for i in range(24)], True),
    "llama4-scout": (48, 40, 8, 128, [(None, None if i % 4 == 3 else 8192) for i in range(48)], False),
}
CACHES = {"float32": (torch.float32, 0), "float16": (torch.float16, 0), "int8": (torch.float32, 8),
          "int4": (torch.float32, 4)}


def model_case(name: str, depth: int, cache: str, gen: torch.Generator):
    """Each layer's (q, cache, metadata, new_kv) for one sequence decoding its token at position ``depth``."""
    layers, hq, hkv, d, variants, with_sinks = MODELS[name]
    dtype, policy = CACHES[cache]
    blocks = -(-(depth + 1) // BLOCK_SIZE)
    table = (torch.randperm(blocks, generator=gen) + 1).tolist()
    history = ops.build_attention_metadata([depth + 1], [depth + 1], [table], BLOCK_SIZE)
    step = ops.build_attention_metadata([1], [depth + 1], [table], BLOCK_SIZE)
    cases = []
    for window, chunk in variants:
        layer = KVLayout(1, hkv, d, BLOCK_SIZE, dtype, policy).allocate(blocks + 1, "cpu")[0]
        k, v = (torch.randn(depth + 1, hkv, d, generator=gen) for _ in range(2))
        ops.fill_kv_cache(k, v, layer, history.slot_mapping)
        sinks = torch.randn(hq, generator=gen) if with_sinks else None
        q = torch.randn(1, hq, d, generator=gen)
        cases.append((q, layer, step.for_layer(window, None, sinks, chunk), (k[-1:], v[-1:]), d ** -0.5))
    return cases


def timed(attend, cases) -> float:
    start = time.perf_counter()
    for q, layer, meta, new_kv, scale in cases:
        attend(q, layer, meta, scale, new_kv)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--depths", default="256,2048", help="context depths (tokens before the decoded one)")
    ap.add_argument("--cache", choices=list(CACHES), default="float16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/attention_variants_speed.json")
    args = ap.parse_args()
    if kernels.load() is None:
        raise SystemExit("the cpu kernels did not build (see the warning logged above): nothing to compare")
    torch.set_num_threads(args.threads)
    backend, gen = CpuBackend(), torch.Generator().manual_seed(0)
    sides = {"kernel": backend.paged_attention, "reference": ops.paged_attention}
    results = {"machine": cpu_info(), "threads": args.threads, "cache": args.cache, "rounds": args.rounds,
               "models": {}}
    print(f"| model | depth | kernel ms | reference ms | reference / kernel |   ({args.cache} cache, "
          f"{args.threads} threads, one decode token over every layer)")
    print("|---|---:|---:|---:|---:|")
    for name in MODELS:
        for depth in (int(d) for d in args.depths.split(",")):
            cases = model_case(name, depth, args.cache, gen)
            for q, layer, meta, new_kv, scale in cases:   # warm-up, and the kernel checked against the reference
                torch.testing.assert_close(backend.paged_attention(q, layer, meta, scale, new_kv),
                                           ops.paged_attention(q, layer, meta, scale, new_kv), atol=1e-4, rtol=1e-4)
            ms: dict[str, list[float]] = {side: [] for side in sides}
            for i in range(args.rounds):
                for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                    ms[side].append(timed(sides[side], cases))
            ratios = [r / k for k, r in zip(ms["kernel"], ms["reference"], strict=True)]
            results["models"].setdefault(name, {})[depth] = {
                **{side: median_min_max(v) for side, v in ms.items()}, "reference / kernel": median_min_max(ratios)}
            print(f"| {name} | {depth} | {spread(ms['kernel'])} | {spread(ms['reference'])} | "
                  f"{spread(ratios)} |", flush=True)
            del cases
    results["load_average_after"] = cpu_info()["load_average"]
    write_result(args.out, results)


if __name__ == "__main__":
    main()
