"""One stream at a time: decode tok/s through `lmport serve` against the engine alone (and llama-server).

A single request's decode is where the server's own work shows most: every token crosses the engine core's
output queue, the front end's event loop and an SSE write, with nothing to overlap it. Workload: --prompt-tokens
prompt tokens cut from a fixed text, --tokens generated with EOS ignored, greedy, one request at a time.

- engine: an Engine in this process with `lmport serve`'s defaults (prefix caching on), stepped until done;
- lmport serve: the same model behind `lmport serve`, a streamed POST /v1/completions with token-id prompts;
- llama-server (when --llama-server gives its binary): the same GGUF, the same streamed request.

Decode tok/s is (tokens - 1) over the time from the first token to the last, so prefill and time to first
token stay out of it (they are printed apart). The rounds interleave the columns; each round's prompt begins
with a token of its own, so no cache answers it. Prints medians with min-max, the served / engine ratio per
round, the CPU and its measured memory bandwidth; writes JSON.

    .venv/bin/python benchmarks/serve_single_stream.py --rounds 5 \\
        --llama-server /root/.cache/llamacpp/build/bin/llama-server
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmport.bench import machine  # noqa: E402
from lmport.bench.client import LLAMA_SERVING, served_url, wait_ready  # noqa: E402
from lmport.bench.datasets import TEXT  # noqa: E402
from lmport.bench.machine import spread, write_result  # noqa: E402
from serve_load import start_server  # noqa: E402
from serve_throughput import WARM_UP_SALT, one_stream, start_llama_server, stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def timing(name: str, tokens: int, first: float | None, last: float | None, error: str | None = None) -> dict:
    """A column's figures: ``tokens`` generated, the first arriving ``first`` and the last ``last`` seconds after
    the request was sent."""
    decode = (tokens - 1) / (last - first) if first is not None and last is not None and last > first else None
    return {"column": name, "tokens": tokens, "ttft_s": first,
            "decode_tokens_per_s": decode, "error": error}


def run_engine(engine, ids: list[int], n: int) -> dict:
    from lmport import GenerationConfig
    start = time.perf_counter()
    first = last = None
    tokens = 0
    engine.add_request(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True, temperature=0))
    while engine.has_unfinished():
        for out in engine.step():
            if out.delta_token_ids:
                last = time.perf_counter() - start
                first = last if first is None else first
                tokens += len(out.delta_token_ids)
    return timing("engine", tokens, first, last)


async def run_served(name: str, http: httpx.AsyncClient, url: str, model: str, ids: list[int], n: int) -> dict:
    first, last, tokens, error = await one_stream(http, url, model, ids, n, time.perf_counter())
    return timing(name, tokens, first, last, error)


def table(rounds: list[list[dict]]) -> str:
    names = [r["column"] for r in rounds[0]]
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key in (("decode tok/s", "decode_tokens_per_s"), ("TTFT s", "ttft_s")):
        cells = [spread([r[key] for rnd in rounds for r in rnd if r["column"] == name and r[key] is not None])
                 for name in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name in names[1:]:
        ratios = [s["decode_tokens_per_s"] / e["decode_tokens_per_s"] for rnd in rounds
                  for e in rnd if e["column"] == "engine" and e["decode_tokens_per_s"]
                  for s in rnd if s["column"] == name and s["decode_tokens_per_s"]]
        lines.append(f"\n{name} / engine, decode tok/s, per round: {spread(ratios)}")
    return "\n".join(lines)


async def main_async(args) -> dict:
    import torch

    from lmport import EngineConfig, GenerationConfig
    from lmport.engine.engine import Engine
    from lmport.models.loader import load_tokenizer, resolve_model_path

    prompt = load_tokenizer(args.model).encode(TEXT, add_special_tokens=False)[:args.prompt_tokens - 1]
    logs = Path(tempfile.mkdtemp(prefix="lmport-serve-single-stream-"))
    print(f"server logs: {logs}", file=sys.stderr)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    served = start_server(args.model, args.serve_args.split(), logs / "lmport.log", args.threads)
    llama = None
    columns = [("lmport serve", served_url(served, logs / "lmport.log", time.monotonic() + 600), served)]
    if args.llama_server:
        llama = start_llama_server(args.llama_server, str(resolve_model_path(args.model)), args.threads, 1,
                                   logs / "llama-server.log")
        columns.append(("llama-server", served_url(llama, logs / "llama-server.log", time.monotonic() + 600,
                                                   LLAMA_SERVING), llama))
    engine = None
    try:
        torch.set_num_threads(args.threads)
        engine = Engine(args.model, EngineConfig(device_type="cpu", enable_prefix_caching=True))
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2, ignore_eos=True))   # warm-up
        while engine.has_unfinished():
            engine.step()
        rounds = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30)) as http:
            for _, url, proc in columns:
                await wait_ready(url, proc, time.monotonic() + 600)
                await run_served("warm-up", http, url, args.model, [WARM_UP_SALT, *prompt], 8)
            for i in range(args.rounds):
                ids = [WARM_UP_SALT + 1 + i, *prompt]
                this = [run_engine(engine, ids, args.tokens)]
                for name, url, _ in columns:
                    this.append(await run_served(name, http, url, args.model, ids, args.tokens))
                print(f"round {i + 1}: " + ", ".join(f"{r['column']} {r['decode_tokens_per_s'] or 0:.1f} tok/s"
                                                      for r in this), file=sys.stderr)
                rounds.append(this)
    finally:
        if engine is not None:
            engine.close()
        stop(served)
        stop(llama)
    return {"workload": {"prompt_tokens": args.prompt_tokens, "tokens": args.tokens}, "model": args.model,
            "threads": args.threads, "serve_args": args.serve_args, "llama_server": args.llama_server,
            "rounds": rounds, "machine": machine.describe()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads (engine, lmport serve) and llama-server -t")
    p.add_argument("--serve-args", default="", help="more `lmport serve` flags")
    p.add_argument("--llama-server", default=None, help="llama-server binary: adds its column")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_single_stream.json"))
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    print(f"\none stream: {args.prompt_tokens}-token prompt, {args.tokens} tokens, {args.rounds} interleaved rounds, "
          f"median (min-max); {machine.line(result['machine'])}\n")
    print(table(result["rounds"]))
    for rnd in result["rounds"]:
        for r in rnd:
            if r["error"]:
                print(f"{r['column']} error: {r['error']}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
