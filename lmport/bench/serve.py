"""`lmport bench serve`: a streamed chat load against any OpenAI-compatible server (lmport serve, llama-server,
vLLM), the same requests and client code for each.

At each --concurrency level, --requests requests (default: as many as the level) are sent with at most that
many in flight, every one streamed, greedy and generating exactly --max-tokens tokens (``ignore_eos``). A
round runs every level once, the levels' order alternating from round to round, so a load that drifts during
the run falls on all of them alike. Per round and level: the median time to first token (TTFT), the median
inter-token latency (ITL: the gaps between streamed chunks of content, over all requests), the median time per
output token after the first (TPOT) and the output tokens/s of the whole load; the report gives each as the
median (min-max) over --rounds rounds. One short request first warms the server up and is not measured.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx

from lmport.bench import client, machine

MEASURES = ("ttft_s", "itl_s", "tpot_s", "output_tokens_per_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True,
                   help="the server's base URL: http://HOST:PORT or http://HOST:PORT/v1 (lmport serve, llama-server, "
                        "vLLM, ...)")
    p.add_argument("--api-key", default=os.environ.get("LMPORT_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="sent as `Authorization: Bearer KEY` (default: $LMPORT_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="the model name the requests give (default: the first the server "
                                                 "lists at /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                   help="requests in flight at once; several levels alternate round by round (default 1 8)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level and round (default: the level's concurrency)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every level once (default 3)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (for a server that refuses ignore_eos; the work then differs)")
    p.add_argument("--json-schema", action="store_true",
                   help="give every request a JSON-schema response_format (the cost of structured outputs)")
    p.add_argument("--timeout", type=float, default=600, help="time bound of one level's load, in seconds")
    p.add_argument("--ready-timeout", type=float, default=60,
                   help="seconds to wait for the server to answer /v1/models (default 60)")


def level_result(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    gaps = [g for r in ok for g in r["itl"]]
    tokens = sum(r["completion_tokens"] for r in results)
    median = lambda xs: statistics.median(xs) if xs else None   # noqa: E731
    return {"requests": len(results), "succeeded": len(ok), "wall_s": wall,
            "ttft_s": median([r["ttft"] for r in ok if r["ttft"] is not None]),
            "ttft_p99_s": client.percentile([r["ttft"] for r in ok if r["ttft"] is not None], 99),
            "itl_s": median(gaps), "itl_p99_s": client.percentile(gaps, 99),
            "tpot_s": median([r["tpot"] for r in ok if r["tpot"] is not None]),
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall else None,
            "errors": sorted({r["error"] for r in results if r["error"]})[:10]}


async def run_level(url: str, model: str, concurrency: int, n: int, args, headers: dict) -> dict:
    bodies = [client.chat_body(model, i, args.max_tokens, args.json_schema, args.ignore_eos) for i in range(n)]
    gate = asyncio.Semaphore(concurrency)

    async def one(http, body):
        async with gate:
            return await client.stream_chat(http, url, body, headers)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30), limits=limits) as http:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(http, body)) for body in bodies]
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        for task in pending:   # past the time bound: closing their streams aborts them on the server
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
    return level_result([t.result() if t in done else client.failed("timed out") for t in tasks], wall)


async def first_model(url: str, headers: dict, model: str | None, timeout: float) -> str:
    """Once the server answers /v1/models: ``model``, else the first model it lists. A server that refuses the key,
    or none answering within ``timeout`` seconds, ends the benchmark with what to do."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            try:
                r = await http.get(url + "/v1/models", headers=headers)
            except httpx.TransportError:
                r = None
            if r is not None and r.status_code in (401, 403):
                raise SystemExit(f"{url}/v1/models answered {r.status_code}: give the server's key with --api-key "
                                 "(or $LMPORT_API_KEY)")
            if r is not None and r.status_code == 200:
                return model or await client.served_model(http, url, headers)
            if time.monotonic() > deadline:
                state = "nothing answered" if r is None else f"it answered {r.status_code}"
                raise SystemExit(f"no OpenAI-compatible server at {url} within {timeout:g} s ({state} at /v1/models): "
                                 "start one (`lmport serve MODEL`) or check --url")
            await asyncio.sleep(0.25)


async def run_async(args) -> dict:
    url = client.base_url(args.url)
    headers = client.auth_headers(args.api_key)
    model = await first_model(url, headers, args.model, args.ready_timeout)
    async with httpx.AsyncClient(timeout=args.timeout) as http:   # warm-up, not measured
        warm = await client.stream_chat(http, url, client.chat_body(model, 0, min(4, args.max_tokens),
                                                                    args.json_schema, args.ignore_eos), headers)
    if not warm["ok"]:
        raise SystemExit(f"{url}: the warm-up request failed: {warm['error']}")
    levels = list(dict.fromkeys(args.concurrency))
    rounds = []
    for r in range(args.rounds):
        order = levels if r % 2 == 0 else levels[::-1]
        rounds.append({})
        for c in order:
            rounds[-1][str(c)] = await run_level(url, model, c, args.requests or c, args, headers)
            s = rounds[-1][str(c)]
            print(f"round {r + 1}, concurrency {c}: {s['succeeded']}/{s['requests']} ok, "
                  f"{s['output_tokens_per_s'] or 0:.1f} output tok/s", flush=True)
    summary = {}
    for c in levels:
        runs = [rnd[str(c)] for rnd in rounds]
        summary[str(c)] = {k: machine.median_min_max([x[k] for x in runs]) if all(x[k] is not None for x in runs)
                           else None for k in MEASURES}
        summary[str(c)]["succeeded"] = sum(x["succeeded"] for x in runs)
        summary[str(c)]["requests"] = sum(x["requests"] for x in runs)
    return {"benchmark": "serve", "url": url, "model": model, "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos, "json_schema": args.json_schema, "concurrency": levels,
            "requests_per_level": {str(c): args.requests or c for c in levels},
            "client_machine": {**machine.cpu_info(), "gpus": machine.gpu_info()}, "rounds": rounds,
            "summary": summary}


def check(args) -> None:
    if min(args.concurrency) < 1 or args.rounds < 1 or args.max_tokens < 1 or (args.requests or 1) < 1:
        raise SystemExit("--concurrency, --requests, --rounds and --max-tokens must be at least 1")


def run(args) -> dict:
    check(args)
    return asyncio.run(run_async(args))


def failures(result: dict) -> int:
    return sum(s["requests"] - s["succeeded"] for s in result["summary"].values())


def report(result: dict) -> str:
    def cell(s, scale=1.0, fmt=".1f"):
        if s is None:
            return "-"
        return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}})"
    lines = [f"{result['url']} ({result['model']}), {result['max_tokens']} tokens a request; median (min-max) of "
             f"{len(result['rounds'])} rounds", "",
             "| concurrency | succeeded | TTFT (ms) | ITL (ms) | TPOT (ms) | output tok/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for c, s in result["summary"].items():
        lines.append(f"| {c} | {s['succeeded']}/{s['requests']} | {cell(s['ttft_s'], 1e3)} | "
                     f"{cell(s['itl_s'], 1e3, '.2f')} | {cell(s['tpot_s'], 1e3, '.2f')} | "
                     f"{cell(s['output_tokens_per_s'])} |")
    errors = sorted({e for rnd in result["rounds"] for lvl in rnd.values() for e in lvl["errors"]})
    if errors:
        lines += ["", "errors:", *(f"  {e}" for e in errors[:10])]
    return "\n".join(lines)
