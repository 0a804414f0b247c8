"""Soak test of `lmport serve`: many requests of every kind for a long time; does anything leak?

Starts `lmport serve MODEL` on a free 127.0.0.1 port and sends --requests
requests, paced over at least --min-minutes, at most --concurrency at once.
The mix: streamed chats that finish, non-streamed completions, streams the
client drops after a few chunks (disconnect), non-streamed requests the client
gives up on (abort), structured outputs (a JSON schema, a regex, a choice; the
answer must match), tool calls (tool_choice required: the call's arguments
must parse), echo scoring (logprobs of the prompt), chats with n > 1 and top
logprobs (each choice must carry them), LoRA adapters loaded, used and
unloaded while everything else runs, slow readers (a stream
read one chunk at a time with pauses, sometimes left unread), and bad requests
(each must get a 4xx, or a 200 where the input is valid but extreme). After
--warmup requests, once it is idle, the server's RSS (with its child processes,
each also on its own: the front end and the engine core) is read; at the end,
once it is idle, RSS, KV blocks used and requests left
(running + waiting + admitted) are read again. Prints a table; writes JSON
to --out. Pass: RSS within 10% of the warm-up reading, 0 blocks used, 0
requests left, no 5xx, no request without an answer.

    .venv/bin/python tools/soak.py                          # 10,000 requests, >= 15 minutes, tiny model
    .venv/bin/python tools/soak.py --requests 300 --min-minutes 0.5   # a quick look
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe import rss_by_process, start_server, tree_rss  # noqa: E402

from lmport.bench.client import metric, percentile, served_url, wait_ready  # noqa: E402
from lmport.bench.machine import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"stream": 0.18, "complete": 0.1, "disconnect": 0.1, "abort": 0.06, "structured": 0.1, "tools": 0.08,
         "echo": 0.06, "logprobs": 0.06, "lora": 0.04, "slow_reader": 0.06, "bad": 0.16}
ADAPTER_NAMES = ("soak-a", "soak-b", "soak-c")
API_KEY = "soak"   # loading adapters at run time needs one
# Seconds a quiet server is left before its RSS is read: an engine core idle for half a second gives back the
# memory it kept for its steps (lmport.engine.core_process.IDLE_WAIT), so both readings are of an idle server.
SETTLE_S = 2.0
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}


def bad_requests(model: str) -> list[tuple[str, dict, object, set[int]]]:
    """(name, headers, body, acceptable statuses): the "Why" cases of the reliability issue, and more."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    json_type = {"Content-Type": "application/json"}
    return [
        ("temperature 1e-300", json_type, {**chat, "temperature": 1e-300}, {200}),
        ("top_k 1e23", json_type, {**chat, "top_k": 10**23}, {400}),
        ("repetition_penalty 1e-320", json_type, {**chat, "repetition_penalty": 1e-320}, {400}),
        ("[[1]] x 5000, n 16", json_type, {"model": model, "prompt": [[1]] * 5000, "n": 16}, {400}),
        ("stop ''", json_type, {**chat, "stop": ""}, {400}),
        ("17 stop strings", json_type, {**chat, "stop": [f"s{i}" for i in range(17)]}, {400}),
        ("100 KB model name", json_type, {**chat, "model": "m" * 100_000}, {404}),
        ("logit_bias out of range", json_type, {**chat, "logit_bias": {"1": 500}}, {400}),
        ("logit_bias id out of vocab", json_type, {**chat, "logit_bias": {str(10**9): 5}}, {400}),
        ("unsatisfiable schema", json_type,
         {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "object", "properties": {}, "required": ["x"], "additionalProperties": False}}}}, {400}),
        ("tool_choice function as a string", json_type,
         {**chat, "tools": [TOOL], "tool_choice": {"type": "function", "function": "get_weather"}}, {400}),
        ("echo past the context", json_type,
         {"model": model, "prompt": "word " * 20_000, "echo": True, "logprobs": 1, "max_tokens": 0}, {400}),
        ("best_of 2", json_type, {**chat, "best_of": 2}, {400}),
        ("malformed JSON", json_type, b'{"model": ', {400}),
        ("text/plain POST", {"Content-Type": "text/plain"}, json.dumps(chat).encode(), {415}),
        ("foreign Host", {**json_type, "Host": "evil.example"}, chat, {421}),
        ("max_tokens 0", json_type, {**chat, "max_tokens": 0}, {400}),
        ("token id out of vocab", json_type, {"model": model, "prompt": [1, 10**9]}, {400}),
    ]


class Soak:
    def __init__(self, url: str, model: str, args, adapters: list[str]):
        self.url, self.model, self.args, self.adapters = url, model, args, adapters
        self.rng = random.Random(args.seed)
        self.bad_cases = bad_requests(model)
        self.counts: collections.Counter = collections.Counter()   # (kind, outcome)
        self.problems: list[str] = []
        self.latencies: dict[str, list[float]] = collections.defaultdict(list)

    def problem(self, text: str) -> None:
        """Counts a problem; keeps the first few examples of each kind (its text up to the first colon), so a
        burst of one kind does not hide the others."""
        self.counts["problem"] += 1
        kind = text.split(":")[0]
        if sum(p.split(":")[0] == kind for p in self.problems) < 5:
            self.problems.append(text)

    async def one(self, http: httpx.AsyncClient, i: int) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        start = time.perf_counter()
        try:
            outcome = await asyncio.wait_for(getattr(self, kind)(http, i), timeout=self.args.hang_after)
        except asyncio.TimeoutError:
            outcome = "hung"
            self.problem(f"request {i} ({kind}) had no answer after {self.args.hang_after} s")
        except httpx.HTTPError as exc:
            outcome = f"transport error {type(exc).__name__}"
            self.problem(f"request {i} ({kind}): {type(exc).__name__}: {exc}")
        self.counts[(kind, outcome)] += 1
        self.latencies[kind].append(time.perf_counter() - start)

    def _chat(self, i: int, stream: bool) -> dict:
        return {"model": self.model, "stream": stream, "max_tokens": self.rng.randint(4, 48),
                "temperature": self.rng.choice([0, 0.7, 1.0]), "ignore_eos": self.rng.random() < 0.5,
                "messages": [{"role": "user", "content": f"Request {i}: tell me about {self.rng.random():.4f}"}]}

    async def _stream(self, http, body: dict, stop_after: int | None) -> str:
        async with http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._status(r)
            chunks = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                if line.startswith("data: "):
                    if '"error"' in line[:20]:
                        self.problem(f"stream error event: {line[:200]}")
                        return "error event"
                    chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        return "disconnected"   # leaving the block closes the connection
            self.problem("a stream ended without [DONE]")
            return "no [DONE]"

    def _status(self, r: httpx.Response) -> str:
        if r.status_code == 503:
            return "503 busy"
        self.problem(f"HTTP {r.status_code}: {r.text[:200]}")
        return f"HTTP {r.status_code}"

    async def stream(self, http, i):
        return await self._stream(http, self._chat(i, True), None)

    async def disconnect(self, http, i):
        body = {**self._chat(i, True), "max_tokens": 200, "ignore_eos": True}
        return await self._stream(http, body, self.rng.randint(1, 5))

    async def complete(self, http, i):
        body = {"model": self.model, "prompt": [f"Text {i}:", "Another"][: self.rng.randint(1, 2)],
                "max_tokens": self.rng.randint(4, 32), "n": self.rng.randint(1, 2), "temperature": 0.8}
        r = await http.post(self.url + "/v1/completions", json=body)
        return "done" if r.status_code == 200 else self._status(r)

    async def abort(self, http, i):
        body = {"model": self.model, "prompt": f"Abort {i}", "max_tokens": 500, "ignore_eos": True}
        try:
            r = await http.post(self.url + "/v1/completions", json=body,
                                timeout=self.rng.uniform(0.05, 0.5))
        except httpx.TimeoutException:
            return "aborted"
        return "done" if r.status_code == 200 else self._status(r)

    async def structured(self, http, i):
        kind = self.rng.choice(["json", "regex", "choice"])
        body = {"model": self.model, "prompt": f"Record {i}:", "max_tokens": 48,
                "temperature": self.rng.choice([0, 0.8])}
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        elif kind == "regex":
            body["guided_regex"] = r"[a-z]{2,6}-[0-9]{3}"
        else:
            body["guided_choice"] = ["red", "green", "blue"]
        r = await http.post(self.url + "/v1/completions", json=body)
        if r.status_code != 200:
            return self._status(r)
        choice = r.json()["choices"][0]
        text = choice["text"]
        if choice["finish_reason"] == "length":
            return "cut at max_tokens"
        ok = {"json": lambda: set(json.loads(text)) == {"name", "age"},
              "regex": lambda: re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", text) is not None,
              "choice": lambda: text in ("red", "green", "blue")}[kind]
        try:
            matched = ok()
        except ValueError:
            matched = False
        if not matched:
            self.problem(f"{kind} output does not match its format: {text!r}")
            return f"{kind} mismatch"
        return f"{kind} matched"

    async def tools(self, http, i):
        body = {"model": self.model, "max_tokens": 64, "tools": [TOOL], "tool_choice": "required",
                "messages": [{"role": "user", "content": f"Weather in city {i}?"}]}
        r = await http.post(self.url + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            return self._status(r)
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            return "cut at max_tokens"
        calls = choice["message"].get("tool_calls") or []
        try:
            if calls and "city" in json.loads(calls[0]["function"]["arguments"]):
                return "called"
        except ValueError:
            pass
        self.problem(f"tool_choice required gave no parseable call: {choice['message']}")
        return "no call"

    async def echo(self, http, i):
        body = {"model": self.model, "prompt": f"Score this text {i} " * self.rng.randint(1, 30), "echo": True,
                "logprobs": 1, "max_tokens": self.rng.choice([0, 4])}
        r = await http.post(self.url + "/v1/completions", json=body)
        if r.status_code != 200:
            return self._status(r)
        logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        if logprobs[0] is not None or any(lp is None for lp in logprobs[1:]):
            self.problem(f"echo logprobs malformed: {logprobs[:4]}")
            return "bad logprobs"
        return "scored"

    async def logprobs(self, http, i):
        n, top = self.rng.randint(1, 4), self.rng.randint(1, 5)
        body = {**self._chat(i, False), "n": n, "logprobs": True, "top_logprobs": top}
        r = await http.post(self.url + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            return self._status(r)
        choices = r.json()["choices"]
        entries = [c["logprobs"]["content"] for c in choices]
        if len(choices) != n or any(not e or any(len(t["top_logprobs"]) != top for t in e) for e in entries):
            self.problem(f"logprobs: {n} choices with {top} top logprobs asked, got {str(choices)[:200]}")
            return "bad logprobs"
        return "scored"

    async def lora(self, http, i):
        """Loads an adapter under one of a few names, generates with it and sometimes unloads it. Requests share
        the names, so a name may be loaded already (409) or unloaded by another request before it is used (a
        404 naming the model): both are right answers."""
        name = self.rng.choice(ADAPTER_NAMES)
        r = await http.post(self.url + "/v1/load_lora_adapter",
                            json={"lora_name": name, "lora_path": self.rng.choice(self.adapters)})
        if r.status_code not in (200, 409):
            return self._status(r)
        body = {**self._chat(i, False), "model": name}
        reply = await http.post(self.url + "/v1/chat/completions", json=body)
        if reply.status_code == 404 and reply.json()["error"]["param"] == "model":
            outcome = "unloaded meanwhile"
        else:
            outcome = "done" if reply.status_code == 200 else self._status(reply)
        if self.rng.random() < 0.3:
            r = await http.post(self.url + "/v1/unload_lora_adapter", json={"lora_name": name})
            if r.status_code not in (200, 404):
                return self._status(r)
        return outcome

    async def slow_reader(self, http, i):
        """Reads a stream a chunk at a time with pauses; one in four stops reading and leaves the socket open a
        while before going (the server's send timeout, not the client, should end that one)."""
        body = {**self._chat(i, True), "max_tokens": 64, "ignore_eos": True}
        stall = self.rng.random() < 0.25
        async with http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._status(r)
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                await asyncio.sleep(0.05)
                if stall:
                    await asyncio.sleep(self.rng.uniform(2, 8))
                    return "stalled, then left"
            self.problem("a slow reader's stream ended without [DONE]")
            return "no [DONE]"

    async def bad(self, http, i):
        name, headers, body, ok = self.rng.choice(self.bad_cases)
        kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
        path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
        r = await http.post(self.url + path, headers=headers, **kwargs)
        if r.status_code in ok:
            return f"{r.status_code} as expected"
        if r.status_code == 503:
            return "503 busy"
        self.problem(f"bad request {name!r}: HTTP {r.status_code} (expected {sorted(ok)}): {r.text[:200]}")
        return f"{name}: HTTP {r.status_code}"


async def idle_metrics(http: httpx.AsyncClient, url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        text = (await http.get(url + "/metrics")).text
        m = {name: metric(text, name) for name in ("lmport_requests_running", "lmport_requests_waiting",
                                                      "lmport_kv_blocks_used", "lmport_requests_admitted")}
        if not any(m.values()) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


async def run(args, url: str, pid: int) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.hang_after, connect=30), limits=limits,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        model = (await http.get(url + "/v1/models")).json()["data"][0]["id"]
        soak = Soak(url, model, args, args.adapters)
        gate = asyncio.Semaphore(args.concurrency)
        interval = args.min_minutes * 60 / args.requests   # pacing: the run lasts at least min_minutes
        start = time.monotonic()
        rss = {"samples": []}

        async def task(i):
            try:
                await soak.one(http, i)
            finally:
                gate.release()

        tasks = []
        for i in range(args.requests):
            await asyncio.sleep(max(0.0, start + i * interval - time.monotonic()))
            await gate.acquire()
            tasks.append(asyncio.create_task(task(i)))
            if i == args.warmup:
                await asyncio.gather(*tasks)          # a quiet moment, like the end
                await asyncio.sleep(SETTLE_S)
                rss["after_warmup"] = tree_rss(pid)
                rss["by_process_after_warmup"] = by_role(pid)
            if i % 500 == 0:
                rss["samples"].append((round(time.monotonic() - start, 1), tree_rss(pid)))
                rss.setdefault("by_process", []).append((i, by_role(pid)))
                print(f"{i} requests sent, {time.monotonic() - start:.0f} s, RSS "
                      f"{rss['samples'][-1][1] / 2**20:.0f} MiB, problems {soak.counts['problem']}", file=sys.stderr)
        await asyncio.gather(*tasks)
        wall = time.monotonic() - start
        after = await idle_metrics(http, url)
        await asyncio.sleep(SETTLE_S)
        rss["end"] = tree_rss(pid)
        rss["by_process_end"] = by_role(pid)
        health = (await http.get(url + "/health")).status_code
    outcomes = collections.defaultdict(dict)
    for key, n in soak.counts.items():
        if key != "problem":
            outcomes[key[0]][key[1]] = n
    return {
        "requests": args.requests, "concurrency": args.concurrency, "wall_s": round(wall, 1),
        "outcomes": outcomes, "problems": soak.counts["problem"], "problem_examples": soak.problems,
        "latency_p50_s": {k: percentile(v, 50) for k, v in soak.latencies.items()},
        "latency_p99_s": {k: percentile(v, 99) for k, v in soak.latencies.items()},
        "rss_after_warmup_mib": rss["after_warmup"] / 2**20, "rss_end_mib": rss["end"] / 2**20,
        "rss_growth_pct": 100 * (rss["end"] - rss["after_warmup"]) / rss["after_warmup"],
        "rss_samples_mib": [(t, round(b / 2**20, 1)) for t, b in rss["samples"]],
        # Which process grew: MiB by role after the warm-up, every 500 requests, and at the end.
        "rss_by_process_mib": {"after_warmup": rss["by_process_after_warmup"], "end": rss["by_process_end"],
                               "samples": rss["by_process"]},
        "running_after": after["lmport_requests_running"], "waiting_after": after["lmport_requests_waiting"],
        "admitted_after": after["lmport_requests_admitted"], "kv_blocks_used_after": after["lmport_kv_blocks_used"],
        "health_after": health,
    }


def table(r: dict) -> str:
    passed = (abs(r["rss_growth_pct"]) <= 10 and r["kv_blocks_used_after"] == 0 and r["problems"] == 0
              and not r["running_after"] and not r["waiting_after"] and not r["admitted_after"])
    rows = [("requests / concurrency", f"{r['requests']} / {r['concurrency']}"),
            ("wall time (min)", f"{r['wall_s'] / 60:.1f}"),
            *((f"{kind}", ", ".join(f"{o}: {n}" for o, n in sorted(v.items()))) for kind, v in
              sorted(r["outcomes"].items())),
            ("problems (5xx, hangs, missing [DONE], unexpected status)", r["problems"]),
            ("RSS after warm-up / end (MiB)", f"{r['rss_after_warmup_mib']:.0f} / {r['rss_end_mib']:.0f} "
                                              f"({r['rss_growth_pct']:+.1f}%)"),
            *((f"RSS of the {role} after warm-up / end (MiB)",
               f"{r['rss_by_process_mib']['after_warmup'].get(role, 0):.0f} / {mib:.0f}")
              for role, mib in r["rss_by_process_mib"]["end"].items()),
            ("KV blocks used at the end", r["kv_blocks_used_after"]),
            ("requests left (running / waiting / admitted)",
             f"{r['running_after']} / {r['waiting_after']} / {r['admitted_after']}"),
            ("/health at the end", r["health_after"]),
            ("pass", "yes" if passed else "no")]
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def by_role(pid: int) -> dict[str, float]:
    """MiB resident by process: the server's own (the HTTP front end) and each child's (the engine core)."""
    roles: dict[str, float] = {}
    for process, size in rss_by_process(pid).items():
        number, name = process.split(" ", 1)
        role = "front end" if int(number) == pid else f"child {name}"
        roles[role] = round(roles.get(role, 0) + size / 2**20, 1)
    return roles


def adapters(model: str) -> list[str]:
    """Two peft adapters (ranks 4 and 8) on ``model``, made by peft (tests/support/lora_adapters.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.lora_adapters import adapter_dir
    return [adapter_dir(model, 4, 1), adapter_dir(model, 8, 2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the tiny random-weight test model")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--min-minutes", type=float, default=15.5)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--hang-after", type=float, default=120.0, help="a request with no answer by then has hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--max-batch-size 16 --max-waiting-requests 48 --request-timeout 60 "
                                            "--cache-max-entry-count 256 --enable-lora-loading --max-loras 2 "
                                            f"--api-key {API_KEY}")
    p.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the server (default: 1)")
    p.add_argument("--out", default=str(ROOT / "tools" / "results" / "soak.json"))
    args = p.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from support.model_helpers import tiny_model_dir
        args.model = tiny_model_dir("llama")
    args.adapters = adapters(args.model)
    log_path = Path(tempfile.mkdtemp(prefix="lmport-soak-")) / "server.log"
    print(f"server log: {log_path}", file=sys.stderr)
    proc = start_server(args.model, shlex.split(args.server_args), log_path, args.torch_threads)
    try:
        url = served_url(proc, log_path, time.monotonic() + 300)
        asyncio.run(wait_ready(url, proc, time.monotonic() + 300))
        result = asyncio.run(run(args, url, proc.pid))
    finally:
        proc.terminate()
        try:
            result_exit = proc.wait(timeout=60)
        except Exception:
            proc.kill()
            result_exit = None
    result.update(exit_code_after_sigterm=result_exit, model=args.model, server_args=args.server_args,
                  host=platform.node(), cpus=os.cpu_count(), python=platform.python_version())
    print(table(result))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
