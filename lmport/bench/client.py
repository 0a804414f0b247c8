"""The benchmarks' HTTP client: streamed chat completions against any OpenAI-compatible server (lmport serve,
llama-server, vLLM), timed chunk by chunk, and the helpers that start `lmport serve` on a free port for them.

Only the OpenAI API is used (``/v1/models``, ``/v1/chat/completions`` with ``stream_options.include_usage``),
plus ``ignore_eos``, which lmport, llama-server and vLLM all take, so that every request generates exactly
``max_tokens`` tokens and servers are compared on equal work."""
from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from lmport.bench.datasets import STORY_SCHEMA, chat_messages

# The lines lmport serve and llama-server print once they listen (llama-server: "main: server is listening on
# URL" in older builds, "llama_server: listening on URL" in newer ones).
SERVING = re.compile(r"^lmport serve: .* on (http://\S+) \(", re.M)
LLAMA_SERVING = re.compile(r"\blistening on (http://\S+)")


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def metric(text: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in a Prometheus text page (a server's /metrics), else None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def base_url(url: str) -> str:
    """A server's address as the requests append to it: ``http://host:port`` from that or ``.../v1``."""
    url = url.rstrip("/")
    if not urlparse(url).scheme.startswith("http"):
        raise ValueError(f"{url!r}: give the server's base URL, e.g. http://127.0.0.1:8000 or http://127.0.0.1:8000/v1")
    return url.removesuffix("/v1")


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def served_url(proc: subprocess.Popen, log_path: Path, deadline: float, pattern: re.Pattern = SERVING) -> str:
    """The address a server started with ``--port 0`` listens on, from the line it prints (the port is the
    one it bound: no other process can take it in between)."""
    while (match := pattern.search(log_path.read_text(errors="replace"))) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: see {log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server printed no address: see {log_path}")
        time.sleep(0.1)
    return match.group(1)


def start_server(model: str, extra: list[str], log_path: Path, threads: int | None,
                 cwd: Path | None = None, bin_dir: Path | None = None) -> subprocess.Popen:
    """`lmport serve MODEL` on a free loopback port (read it with served_url), its output in ``log_path``; the
    `lmport` of ``bin_dir`` (another checkout's venv) where given, else this interpreter's."""
    lmport = (bin_dir or Path(sys.executable).parent) / "lmport"
    cmd = [str(lmport)] if lmport.exists() else [sys.executable, "-m", "lmport"]
    cmd += ["serve", model, "--host", "127.0.0.1", "--port", "0", *extra]
    print("starting:", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=cwd, env=env)


async def wait_ready(url: str, proc: subprocess.Popen | None, deadline: float, path: str = "/health",
                     headers: dict | None = None) -> None:
    """Until ``url + path`` answers 200 (the server ``proc``, if given, still running), else TimeoutError."""
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if (await http.get(url + path, headers=headers)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server at {url} did not answer {path} in time")
            await asyncio.sleep(0.25)


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(http: httpx.AsyncClient, url: str, headers: dict) -> str:
    """The first model the server lists (``/v1/models``)."""
    r = await http.get(url + "/v1/models", headers=headers)
    r.raise_for_status()
    models = r.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return models[0]["id"]


def chat_body(model: str, i: int, max_tokens: int, schema: bool = False, ignore_eos: bool = True) -> dict:
    """Request ``i`` of a load: greedy, streamed with its usage, ``max_tokens`` tokens (all of them with
    ``ignore_eos``); with ``schema`` a JSON-schema response_format (datasets.STORY_SCHEMA)."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0, "messages": chat_messages(i)}
    if ignore_eos:
        body["ignore_eos"] = True
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}}
    return body


def failed(error: str) -> dict:
    return {"ok": False, "ttft": None, "itl": [], "latency": None, "tpot": None, "completion_tokens": 0,
            "error": error}


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    """One streamed chat completion, timed: ``ttft`` (seconds to the first content), ``itl`` (the gaps between
    the chunks of content after it), ``latency``, ``tpot`` ((latency - ttft) / (tokens - 1)), the completion
    tokens (the usage the server sends, else the content chunks counted) and ``ok``: the stream ended with
    [DONE] after max_tokens tokens (any count without ``ignore_eos``)."""
    start = time.perf_counter()
    result = failed("")
    result["error"] = None
    chunks, last = 0, None
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return failed(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return failed(str(chunk["error"].get("message", chunk["error"])))
                if chunk.get("usage"):
                    result["completion_tokens"] = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if last is None:
                        result["ttft"] = now - start
                    else:
                        result["itl"].append(now - last)
                    last = now
                    chunks += 1
        result["latency"] = time.perf_counter() - start
        result["completion_tokens"] = result["completion_tokens"] or chunks
        if result["ttft"] is not None and result["completion_tokens"] > 1:
            result["tpot"] = (result["latency"] - result["ttft"]) / (result["completion_tokens"] - 1)
        enough = not body.get("ignore_eos") or result["completion_tokens"] == body["max_tokens"]
        result["ok"] = done and enough
        if not result["ok"]:
            result["error"] = f"stream ended early ({result['completion_tokens']} of {body['max_tokens']} tokens)"
    except httpx.HTTPError as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    return result


async def run_requests(url: str, bodies: list[dict], headers: dict, timeout: float) -> tuple[list[dict], float]:
    """``bodies`` sent at once, each streamed on a connection of its own; their results and the wall time.
    Past ``timeout`` seconds the rest are cancelled (closing a stream aborts its request on the server)."""
    n = len(bodies)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as http:
        start = time.perf_counter()
        tasks = [asyncio.create_task(stream_chat(http, url, body, headers)) for body in bodies]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
    return [t.result() if t in done else failed("timed out") for t in tasks], wall
