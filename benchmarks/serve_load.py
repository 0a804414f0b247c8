"""Load test of `lmport serve`: N concurrent streamed chat completions over loopback.

Starts `lmport serve MODEL` on a free 127.0.0.1 port (or uses --url, which
must be a loopback address), sends --requests streamed requests at once,
each generating exactly --max-tokens tokens (ignore_eos), and reports the
success count, time to first token p50/p99 and output tokens/s. Bounded in
count and time: everything stops after --timeout seconds and the server it
started is shut down. Prints a markdown table; writes JSON to --out.

    .venv/bin/python benchmarks/serve_load.py                  # 200 requests, smollm2
    .venv/bin/python benchmarks/serve_load.py --requests 20 --max-tokens 16 --model /path/to/model
    .venv/bin/python benchmarks/serve_load.py --json-schema both   # the cost of structured outputs

``--json-schema on`` gives every request a JSON-schema response_format (STORY_SCHEMA, whose
story is longer than any --max-tokens, so each request still generates exactly --max-tokens
tokens); ``both`` runs the load without and then with it against the same server, side by side.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# The shared client (lmport.bench.client): served_url, start_server, wait_ready and percentile are imported from
# here by the other serving scripts too.
from lmport.bench import client
from lmport.bench.client import (LLAMA_SERVING, SERVING, chat_body, is_loopback, metric, percentile,  # noqa: F401
                                 served_url, stream_chat, wait_ready)
from lmport.bench.datasets import STORY_SCHEMA, TOPICS  # noqa: F401
from lmport.bench.machine import write_result

ROOT = Path(__file__).resolve().parents[1]


def start_server(model: str, extra: list[str], log_path: Path, threads: int | None) -> subprocess.Popen:
    """`lmport serve MODEL` on a free loopback port, run from the repository's root."""
    return client.start_server(model, extra, log_path, threads, cwd=ROOT)


async def one_request(http: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int,
                      headers: dict, schema: bool = False) -> dict:
    """Request ``i`` of the load, streamed and timed (lmport.bench.client.stream_chat)."""
    return await stream_chat(http, url, chat_body(model, i, max_tokens, schema), headers)


async def run_load(url: str, model: str, n: int, max_tokens: int, api_key: str | None, timeout: float,
                   schema: bool = False) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as http:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one_request(http, url, model, i, max_tokens, headers, schema))
                 for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:  # past the time bound: stop them (closing the stream aborts them on the server)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
        results = [t.result() if t in done else {"ok": False, "error": "timed out", "completion_tokens": 0,
                                                  "ttft": None, "itl": [], "latency": None, "tpot": None}
                   for t in tasks]
        metrics_text = (await http.get(url + "/metrics", headers=headers)).text
    ok = [r for r in results if r["ok"]]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["completion_tokens"] for r in results)
    errors = sorted({r["error"] for r in results if r["error"]})
    return {
        "requests": n, "succeeded": len(ok), "max_tokens": max_tokens, "wall_s": wall,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "ttft_max_s": max(ttfts, default=None),
        "latency_p50_s": percentile([r["latency"] for r in ok], 50),
        "tpot_p50_s": percentile([r["tpot"] for r in ok if r["tpot"] is not None], 50),
        "json_schema": schema,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall else None,
        "errors": errors[:10],
        "server_running_after": metric(metrics_text, "lmport_requests_running"),
        "server_kv_blocks_used_after": metric(metrics_text, "lmport_kv_blocks_used"),
    }


def table(runs: list[dict]) -> str:
    def s(x):
        return "-" if x is None else f"{x:.3f}"
    rows = [("requests (concurrent)", "requests"), ("succeeded", "succeeded"),
            ("output tokens per request", "max_tokens"), ("wall time (s)", "wall_s"),
            ("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p99 (s)", "ttft_p99_s"),
            ("request latency p50 (s)", "latency_p50_s"), ("time per output token p50 (s)", "tpot_p50_s"),
            ("output tokens", "output_tokens"), ("output tokens/s", "output_tokens_per_s")]
    lines = ["| metric | " + " | ".join("JSON schema" if r["json_schema"] else "no constraint" for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(s(r[key]) if isinstance(r[key], float) else str(r[key])
                                                  for r in runs) + " |")
    lines.append("| running after / KV blocks used after | " + " | ".join(
        f"{r['server_running_after']} / {r['server_kv_blocks_used_after']}" for r in runs) + " |")
    plain = [r for r in runs if not r["json_schema"] and r["output_tokens_per_s"]]
    schema = [r for r in runs if r["json_schema"] and r["output_tokens_per_s"]]
    if plain and schema:
        def mean(rs, key):
            return sum(r[key] for r in rs) / len(rs)
        lines.append(f"\nJSON schema vs none (means over {len(schema)} and {len(plain)} runs): output tokens/s "
                     f"{mean(schema, 'output_tokens_per_s') / mean(plain, 'output_tokens_per_s') - 1:+.1%}, "
                     f"time per output token p50 {mean(schema, 'tpot_p50_s') / mean(plain, 'tpot_p50_s') - 1:+.1%}")
    return "\n".join(lines)


async def main_async(args) -> list[dict]:
    proc = None
    if args.url:
        if not is_loopback(args.url):
            raise SystemExit(f"--url must be a loopback address (127.0.0.1, ::1, localhost), got {args.url}")
        url = args.url.rstrip("/")
    else:
        log_path = Path(tempfile.mkdtemp(prefix="lmport-serve-load-")) / "server.log"
        print(f"server log: {log_path}", file=sys.stderr)
        proc = start_server(args.model, shlex.split(args.server_args), log_path, args.torch_threads)
        url = served_url(proc, log_path, time.monotonic() + 300)
    try:
        await wait_ready(url, proc, time.monotonic() + 300)
        async with httpx.AsyncClient(timeout=30) as http:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = (await http.get(url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        # One short request first, so start-up costs (first forward, allocator warm-up) are not measured.
        async with httpx.AsyncClient(timeout=300) as http:
            await one_request(http, url, model, 0, 4, headers, args.json_schema != "off")
        # Alternating rounds, so a machine whose load drifts during the run affects both sides alike.
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.json_schema] * args.rounds
        runs = [await run_load(url, model, args.requests, args.max_tokens, args.api_key, args.timeout, schema)
                for schema in modes]
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for result in runs:
        result.update(model=args.model if not args.url else model, url=url, server_args=args.server_args,
                      torch_threads=args.torch_threads,
                      host=platform.node(), cpus=os.cpu_count(), python=platform.python_version())
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model for the server this script starts")
    p.add_argument("--url", default=None, help="use a running server on loopback instead of starting one")
    p.add_argument("--api-key", default=os.environ.get("LMPORT_API_KEY"))
    p.add_argument("--requests", type=int, default=200, help="concurrent streamed requests (default 200)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (default 64)")
    p.add_argument("--timeout", type=float, default=600, help="time bound for the load, in seconds")
    p.add_argument("--server-args", default="", help='extra `lmport serve` flags, e.g. "--max-batch-size 128"')
    p.add_argument("--torch-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the server (on a busy CPU, 1 avoids threads spinning against each other)")
    p.add_argument("--json-schema", choices=["off", "on", "both"], default="off",
                   help="a JSON-schema response_format on every request; both: without, then with (default off)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the load (alternating with --json-schema both)")
    p.add_argument("--out", default=None, help="JSON results (default benchmarks/results/serve_load.json, "
                                                "serve_load_json_schema.json with --json-schema)")
    args = p.parse_args()
    runs = asyncio.run(main_async(args))
    print(table(runs))
    for result in runs:
        if result["errors"]:
            print("errors:", *result["errors"], sep="\n  ")
    name = "serve_load.json" if args.json_schema == "off" else "serve_load_json_schema.json"
    out = Path(args.out or ROOT / "benchmarks" / "results" / name)
    write_result(out, runs[0] if len(runs) == 1 else runs)
    return 0 if all(r["succeeded"] == r["requests"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
