"""A decode step of one Gated DeltaNet layer's delta rule on the cpu backend, three ways, at Qwen3-Next-80B's widths
(16 key heads, 32 value heads of 128; a float32 state pool of 64 slots, the batch's sequences in every other slot):

- reference: lmport.ops.gated_delta_net.recurrent_gated_delta_rule on the gathered states, written back;
- kernel, gathered: the compiled kernel on the gathered states, written back (the Backend's default in-place op
  around the cpu backend's functional one);
- kernel, in place: the compiled kernel updating each state in its slot (what the model calls).

Each way --rounds rounds of --calls calls in turn, after a warm-up; median (min-max) of the rounds' mean ms a call.

    .venv/bin/python benchmarks/gated_delta_rule_speed.py [--batches 1,8] [--threads 2] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lmport.backends.cpu import CpuBackend
from lmport.bench.machine import describe, line
from lmport.ops import gated_delta_net
from lmport.platform.backend import Backend

KEY_HEADS, VALUE_HEADS, HEAD_DIM, SLOTS = 16, 32, 128, 64


def step_inputs(batch: int, gen: torch.Generator):
    """q, k, v, g, beta of one decode token per sequence, split from one conv output as the model splits it."""
    mixed = torch.randn(batch, 1, (2 * KEY_HEADS + VALUE_HEADS) * HEAD_DIM, generator=gen)
    q, k, v = mixed.split([KEY_HEADS * HEAD_DIM, KEY_HEADS * HEAD_DIM, VALUE_HEADS * HEAD_DIM], dim=-1)
    q, k = q.unflatten(-1, (KEY_HEADS, HEAD_DIM)), k.unflatten(-1, (KEY_HEADS, HEAD_DIM))
    v = v.unflatten(-1, (VALUE_HEADS, HEAD_DIM))
    return (q, k, v, -F.softplus(torch.randn(batch, 1, VALUE_HEADS, generator=gen)),
            torch.sigmoid(torch.randn(batch, 1, VALUE_HEADS, generator=gen)))


def reference(args, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out, state = gated_delta_net.recurrent_gated_delta_rule(*args, pool[slots])
    pool[slots] = state
    return out


def ways(backend: CpuBackend, step, pool: torch.Tensor, slots: torch.Tensor) -> dict:
    return {"reference": lambda: reference(step, pool, slots),
            "gathered": lambda: Backend.recurrent_gated_delta_rule_in_place(backend, *step, pool, slots),
            "in place": lambda: backend.recurrent_gated_delta_rule_in_place(*step, pool, slots)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend, gen = CpuBackend(), torch.Generator().manual_seed(0)
    print(f"{line(describe(args.threads))}; {args.threads} threads; ms a call, median (min-max) of {args.rounds} "
          "rounds\n")
    print("| sequences | reference | kernel, gathered | kernel, in place | reference / in place |")
    print("|---:|---:|---:|---:|---:|")
    for batch in map(int, args.batches.split(",")):
        calls = ways(backend, step_inputs(batch, gen),
                     torch.randn(SLOTS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.1,
                     torch.arange(0, 2 * batch, 2))
        ms = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                call()
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                ms[name].append((time.perf_counter() - start) / args.calls * 1e3)
        cell = {name: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for name, v in ms.items()}
        ratio = statistics.median(ms["reference"]) / statistics.median(ms["in place"])
        print(f"| {batch} | {cell['reference']} | {cell['gathered']} | {cell['in place']} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
