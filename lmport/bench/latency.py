"""`lmport bench latency`: single-stream prefill and decode of one model, one request at a time.

- prefill: one engine step over a prompt of --prompt-tokens tokens (the step that gives the first token);
- decode: --decode-tokens tokens after a one-token prompt (depth 0) and after the --prompt-tokens prompt
  (attention over the context is part of a decode step), the prompt's own step left out.

Each round measures the three in turn, after a warm-up round that is not kept, so a load that drifts during
the run falls on all of them alike; the report gives tokens/s and ms/token as the median (min-max) of --rounds
rounds, every round kept in the JSON. The machine's memory read bandwidth is measured in the same run: a decode
step reads every weight once, so bandwidth / weight bytes is the fastest a single stream can decode on a CPU.
"""
from __future__ import annotations

import argparse
import time

from lmport.bench import machine
from lmport.bench.datasets import long_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2", help="smollm2, a local HF directory or a .gguf file")
    p.add_argument("--prompt-tokens", type=int, default=256,
                   help="the prefill's prompt, and the second decode's depth (default 256)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens each decode measures (default 128)")
    p.add_argument("--rounds", type=int, default=5, help="rounds kept, after one warm-up round (default 5)")


def measures(prompt_tokens: int) -> tuple[str, ...]:
    return ("prefill", "decode@0", f"decode@{prompt_tokens}")


def step(engine) -> None:
    """One engine step; a request the engine ended with an error ends the benchmark (a figure timed over a
    failure would be a figure of nothing)."""
    for out in engine.step():
        if out.error:
            raise RuntimeError(f"the engine ended a request with an error: {out.error}")


def generate(engine, prompt: list[int], new: int, decode_only: bool) -> float:
    """Seconds to generate ``new`` tokens after ``prompt`` (EOS ignored); with ``decode_only`` the first step
    (the prompt's prefill, which gives the first token) left out."""
    from lmport.config import GenerationConfig
    engine.add_request(prompt, GenerationConfig(max_new_tokens=new, ignore_eos=True))
    start = time.perf_counter()
    step(engine)
    first = time.perf_counter()
    while engine.has_unfinished():
        step(engine)
    return time.perf_counter() - (first if decode_only else start)


def one_round(engine, prompt: list[int], decode_tokens: int) -> dict:
    """tokens/s of the prefill and of the decodes at depth 0 and at the prompt's length."""
    out = {"prefill": len(prompt) / generate(engine, prompt, 1, False)}
    for depth in (0, len(prompt)):
        out[f"decode@{depth}"] = decode_tokens / generate(engine, prompt[:max(depth, 1)], 1 + decode_tokens, True)
    return out


def run(args, config) -> dict:
    import dataclasses

    import torch

    from lmport.engine.engine import Engine
    if args.prompt_tokens < 2 or args.decode_tokens < 1 or args.rounds < 1:
        raise SystemExit("--prompt-tokens must be at least 2, --decode-tokens and --rounds at least 1")
    if config.max_prefill_token_num < args.prompt_tokens:   # the prefill is one step
        config = dataclasses.replace(config, max_prefill_token_num=args.prompt_tokens)
    engine = Engine(args.model, config)
    try:
        prompt = long_prompt(engine.tokenizer, args.prompt_tokens)
        one_round(engine, prompt, args.decode_tokens)   # warm-up: kernels built, caches touched
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(engine, prompt, args.decode_tokens))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in rounds[-1].items()), flush=True)
        backend, weight_bytes = engine.backend.capabilities.device_type, engine.weight_bytes
    finally:
        engine.close()
    info = machine.describe(torch.get_num_threads())
    result = {"benchmark": "latency", "model": args.model, "backend": backend, "weight_bytes": weight_bytes,
              "config": machine.config_fields(config), "prompt_tokens": args.prompt_tokens,
              "decode_tokens": args.decode_tokens, "machine": info, "torch_threads": torch.get_num_threads(),
              "rounds": rounds,
              "summary": {k: machine.median_min_max([r[k] for r in rounds]) for k in measures(args.prompt_tokens)}}
    if backend == "cpu":   # no decode reads fewer bytes than the weights: the fastest a CPU decodes
        result["byte_limit_tok_s"] = info["memory_bandwidth"]["best_gbs"] * 1e9 / weight_bytes
    return result


def report(result: dict) -> str:
    lines = [f"{result['model']} on {result['backend']} ({result['weight_bytes']:,} weight bytes); "
             f"{machine.line(result['machine'])}; torch threads {result['torch_threads']}",
             f"median (min-max) of {len(result['rounds'])} rounds", "",
             "| measure | tok/s | ms/token |", "|---|---:|---:|"]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) | "
                     f"{1e3 / s['median']:.2f} ({1e3 / s['max']:.2f}-{1e3 / s['min']:.2f}) |")
    if "byte_limit_tok_s" in result:
        lines.append(f"| decode byte limit (read bandwidth / weight bytes) | {result['byte_limit_tok_s']:.0f} | |")
    return "\n".join(lines)
