"""The `make bench` workload through the engine alone, through `lmport serve`, and through llama-server, side by side.

Workload (benchmarks/throughput.py's): --requests requests (default 64), prompts of 8-256 tokens cut from a
fixed text, outputs of 16/32/64/128 tokens with EOS ignored, seed 0, all sent at t=0, greedy.

- engine: the requests added to an Engine in this process, stepped until done (no HTTP, no second process);
- lmport serve: the same engine settings behind `lmport serve` (engine core in its own process), each request
  a streamed POST /v1/completions with the prompt as token ids;
- llama-server (when --llama-server gives its binary): the same GGUF, the same streamed requests.

The servers are started once, warmed up, then the rounds interleave the columns (engine, served, llama-server,
engine, ...) so that load drifting on a shared machine touches each alike. Each round's prompts begin with a
token of their own, so that no column finds an earlier round's prompts in a cache (lmport's prefix cache,
llama-server's slots); within a round the engine runs with prefix caching on, as `lmport serve` does.
Prints medians with min-max over the rounds, the CPU and its measured memory bandwidth, and the load average;
writes JSON.

    .venv/bin/python benchmarks/serve_throughput.py --rounds 5 \\
        --llama-server /root/.cache/llamacpp/build/bin/llama-server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmport.bench import machine  # noqa: E402
from lmport.bench.client import LLAMA_SERVING, percentile, served_url, wait_ready  # noqa: E402
from lmport.bench.datasets import workload  # noqa: E402
from lmport.bench.machine import write_result  # noqa: E402
from serve_load import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WARM_UP_SALT = 1000     # a token id; round i's prompts start with WARM_UP_SALT + 1 + i


def summary(name: str, wall: float, ttfts: list[float], tokens: int, n: int, errors: list[str]) -> dict:
    return {"column": name, "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "requests_per_s": n / wall, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "errors": sorted(set(errors))[:5]}


def salted(requests, salt: int) -> list[tuple[list[int], int]]:
    """``requests`` with ``salt`` as every prompt's first token: a round no cache has seen before."""
    return [([salt, *ids], n) for ids, n in requests]


def run_engine(engine, requests) -> dict:
    from lmport import GenerationConfig
    start = time.perf_counter()
    first: dict[str, float] = {}
    tokens = 0
    for i, (ids, n) in enumerate(requests):
        engine.add_request(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True), request_id=f"r{time.time()}-{i}")
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.delta_token_ids)
            if out.delta_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
    return summary("engine", time.perf_counter() - start, list(first.values()), tokens, len(requests), [])


async def one_stream(http: httpx.AsyncClient, url: str, model: str, ids: list[int], n: int, start: float) -> tuple:
    """(time to the first text, time to the last text, tokens generated, error or None) of one streamed
    completion, the times in seconds since ``start``; the token count from usage (a token that ends no
    character yet sends no text of its own)."""
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first, last, tokens, error = None, None, 0, None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None, None, 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return first, last, tokens, str(chunk["error"])[:200]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    last = time.perf_counter() - start
                    first = last if first is None else first
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is None and tokens != n:
        error = f"{tokens} of {n} tokens"
    return first, last, tokens, error


async def run_served(name: str, url: str, model: str, requests, timeout: float) -> dict:
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(http, url, model, ids, n, start) for ids, n in requests))
        wall = time.perf_counter() - start
    return summary(name, wall, [t for t, _, _, _ in results if t is not None], sum(k for _, _, k, _ in results),
                   len(requests), [e for _, _, _, e in results if e])


def start_llama_server(binary: str, gguf: str, threads: int, slots: int, log: Path,
                       extra: Sequence[str] = ()) -> subprocess.Popen:
    """llama-server on a port it picks (its address: serve_load.served_url with LLAMA_SERVING), ``extra`` flags
    after the others."""
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", "0", "-t", str(threads), "-np", str(slots),
           "-cb", "-c", str(slots * 2048), *extra]
    print("starting:", " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def table(rounds: list[list[dict]]) -> str:
    names = [r["column"] for r in rounds[0]]
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key in (("output tok/s", "output_tokens_per_s"), ("requests/s", "requests_per_s"),
                       ("TTFT p50 s", "ttft_p50_s"), ("TTFT p99 s", "ttft_p99_s"), ("wall s", "wall_s")):
        cells = [machine.spread([r[key] for rnd in rounds for r in rnd if r["column"] == name and r[key] is not None])
                 for name in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    engine = [r["output_tokens_per_s"] for rnd in rounds for r in rnd if r["column"] == "engine"]
    for name in names[1:]:
        ratios = [s["output_tokens_per_s"] / e["output_tokens_per_s"] for rnd in rounds
                  for e in rnd if e["column"] == "engine" for s in rnd if s["column"] == name]
        lines.append(f"\n{name} / engine, output tok/s, per round: {machine.spread(ratios)}")
    if not engine:
        lines.append("\n(no engine column)")
    return "\n".join(lines)


async def main_async(args) -> dict:
    from lmport import EngineConfig, GenerationConfig
    from lmport.engine.engine import Engine
    from lmport.models.loader import load_tokenizer, resolve_model_path

    requests = workload(load_tokenizer(args.model), args.requests, args.seed)
    logs = Path(tempfile.mkdtemp(prefix="lmport-serve-throughput-"))
    print(f"server logs: {logs}", file=sys.stderr)
    env_threads = {"OMP_NUM_THREADS": str(args.threads)}
    os.environ.update(env_threads)
    engine_flags = ["--max-batch-size", str(args.max_batch_size), "--cache-max-entry-count", str(args.blocks),
                    "--dtype", "float32", *args.serve_args.split()]
    served = start_server(args.model, engine_flags, logs / "lmport.log", args.threads)
    llama = None
    llama_url = None
    if args.llama_server:
        llama = start_llama_server(args.llama_server, str(resolve_model_path(args.model)), args.threads,
                                   args.llama_slots, logs / "llama-server.log")
        llama_url = served_url(llama, logs / "llama-server.log", time.monotonic() + 600, LLAMA_SERVING)
    url = served_url(served, logs / "lmport.log", time.monotonic() + 600)
    engine = None
    try:
        import torch
        torch.set_num_threads(args.threads)
        engine = Engine(args.model, EngineConfig(device_type="cpu", dtype="float32", max_batch_size=args.max_batch_size,
                                                 cache_max_entry_count=args.blocks, enable_prefix_caching=True))
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2, ignore_eos=True))   # warm-up
        while engine.has_unfinished():
            engine.step()
        await wait_ready(url, served, time.monotonic() + 600)
        columns = [("lmport serve", url, args.model)]
        if llama is not None and llama_url is not None:
            await wait_ready(llama_url, llama, time.monotonic() + 600)
            columns.append(("llama-server", llama_url, args.model))
        for name, u, model in columns:   # warm-up: first forwards, allocators
            await run_served(name, u, model, salted(requests[:2], WARM_UP_SALT), args.timeout)
        rounds = []
        for i in range(args.rounds):
            this_round = salted(requests, WARM_UP_SALT + 1 + i)
            this = [run_engine(engine, this_round)]
            for name, u, model in columns:
                this.append(await run_served(name, u, model, this_round, args.timeout))
            print(f"round {i + 1}: " + ", ".join(f"{r['column']} {r['output_tokens_per_s']:.1f} tok/s"
                                                  for r in this), file=sys.stderr)
            rounds.append(this)
    finally:
        if engine is not None:
            engine.close()
        stop(served)
        stop(llama)
    return {"workload": {"requests": args.requests, "prompt_tokens": "8-256", "output_tokens": [16, 32, 64, 128],
                         "seed": args.seed}, "model": args.model, "threads": args.threads,
            "max_batch_size": args.max_batch_size, "blocks": args.blocks, "serve_args": args.serve_args,
            "llama_server": args.llama_server, "llama_slots": args.llama_slots, "rounds": rounds,
            "machine": machine.describe()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads (engine, lmport serve) and llama-server -t")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2400, help="KV blocks of 16 tokens for lmport")
    p.add_argument("--serve-args", default="", help="more `lmport serve` flags")
    p.add_argument("--llama-server", default=None, help="llama-server binary: adds its column")
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server -np")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_throughput.json"))
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    print(f"\n{args.requests} requests (prompts 8-256 tokens, outputs 16-128), {args.rounds} interleaved rounds, "
          f"median (min-max); {machine.line(result['machine'])}\n")
    print(table(result["rounds"]))
    for rnd in result["rounds"]:
        for r in rnd:
            if r["errors"]:
                print(f"{r['column']} errors:", *r["errors"], sep="\n  ")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
