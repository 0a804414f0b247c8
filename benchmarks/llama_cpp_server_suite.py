"""llama.cpp's own server test suite, run against `lmport serve`: its OpenAI-shaped tests as an outside check.

llama.cpp ships a pytest suite for llama-server (`tools/server/tests`). Its OpenAI-shaped tests (chat
completions, completions, tool calls, the Responses and Anthropic compatibility layers, embeddings, security) check
the wire format strictly: no empty content deltas, usage in the last chunk, error shapes, CORS, API keys. This
script copies the suite, points it at one `lmport serve` process through an adapter that only adds the `/v1` prefix
to the OpenAI routes and the `model` field where a test leaves it out (the suite's own "external server" mode does
the rest), runs the chosen files, and sorts the results by test file.

Many tests assert the exact text or prompt-token count of llama.cpp's tiny test model (stories260K); against
another model those fail for a reason that is not a protocol defect. Each failure is listed with its message so it
can be read: the JSON keeps them all.

    python benchmarks/llama_cpp_server_suite.py --python /root/.venvs/llama-suite/bin/python
    python benchmarks/llama_cpp_server_suite.py --files test_chat_completion.py -k "stream or logprobs"

The suite needs its own requirements (tools/server/tests/requirements.txt) in the venv given by --python.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmport.bench.client import served_url, wait_ready  # noqa: E402
from serve_load import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = ["test_basic.py", "test_chat_completion.py", "test_completion.py", "test_tool_call.py",
                 "test_security.py", "test_compat_oai_responses.py", "test_compat_anthropic.py", "test_embedding.py"]

# Loaded into the suite's pytest with -p: the suite's external-server mode (DEBUG_EXTERNAL, PORT) plus the /v1
# prefix and the model field. Nothing else about the requests or the assertions changes.
ADAPTER = '''
import os
import utils

OPENAI_ROUTES = ("/chat/completions", "/completions", "/models", "/embeddings", "/responses", "/messages",
                 "/messages/count_tokens")
MODEL = os.environ["LMPORT_SUITE_MODEL"]
_make_url, _make_request, _make_stream_request = (utils.ServerProcess.make_url, utils.ServerProcess.make_request,
                                                  utils.ServerProcess.make_stream_request)


def _with_model(data):
    if isinstance(data, dict) and data.get("model") is None:
        return {**data, "model": MODEL}
    return data


def make_url(self, path, host=None):
    if path.split("?")[0] in OPENAI_ROUTES:
        path = "/v1" + path
    return _make_url(self, path, host)


def make_request(self, method, path, data=None, *args, **kwargs):
    return _make_request(self, method, path, _with_model(data), *args, **kwargs)


def make_stream_request(self, method, path, data=None, *args, **kwargs):
    return _make_stream_request(self, method, path, _with_model(data), *args, **kwargs)


utils.ServerProcess.make_url = make_url
utils.ServerProcess.make_request = make_request
utils.ServerProcess.make_stream_request = make_stream_request
utils.ServerPreset.load_all = staticmethod(lambda: None)   # downloads llama.cpp's test models: not needed
'''


def llama_cpp_source(given: str | None) -> Path:
    candidates = [given] if given else sorted(glob.glob("/root/.cache/llamacpp/llama_cpp_python-*/vendor/llama.cpp"))
    for c in candidates:
        if c and (Path(c) / "tools/server/tests/utils.py").exists():
            return Path(c)
    sys.exit("no llama.cpp source with tools/server/tests found: pass --llama-src (the llama-cpp-python sdist's "
             "vendor/llama.cpp, from `pip download --no-deps --no-binary :all: llama-cpp-python`)")


def results(junit: Path) -> list[dict]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip().splitlines()[0][:300] if (
                    child.get("message") or child.text) else ""
        rows.append({"file": case.get("classname", "").split(".")[-1] + ".py", "test": case.get("name"),
                     "outcome": outcome, "message": message})
    return rows


def table(rows: list[dict]) -> str:
    files: dict[str, dict[str, int]] = {}
    for r in sorted(rows, key=lambda r: r["file"]):
        files.setdefault(r["file"], {"passed": 0, "failed": 0, "error": 0, "skipped": 0})[r["outcome"]] += 1
    lines = ["| file | passed | failed | error | skipped |", "|---|---|---|---|---|"]
    files["all"] = {k: sum(c[k] for c in files.values()) for k in ("passed", "failed", "error", "skipped")}
    lines += [f"| {f} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |" for f, c in files.items()]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-src", default=None, help="llama.cpp source tree (default: the cached sdist's)")
    p.add_argument("--python", default=sys.executable, help="a Python with the suite's requirements")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="test files under tools/server/tests/unit")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--server-args", default="--session-len 4096", help="extra `lmport serve` arguments")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llama_cpp_server_suite.json"))
    args = p.parse_args()

    source = llama_cpp_source(args.llama_src)
    work = Path(tempfile.mkdtemp(prefix="lmport-llama-suite-"))
    suite = work / "tests"
    shutil.copytree(source / "tools/server/tests", suite)
    (suite / "lmport_adapter.py").write_text(ADAPTER)
    files = [f for f in args.files if (suite / "unit" / f).exists()]

    proc = start_server(args.model, shlex.split(args.server_args), work / "server.log", None)
    try:
        url = served_url(proc, work / "server.log", time.monotonic() + 300)
        port = url.rpartition(":")[2]
        asyncio.run(wait_ready(url, proc, time.monotonic() + 300))
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        env = dict(os.environ, DEBUG_EXTERNAL="1", PORT=port, LMPORT_SUITE_MODEL=model)
        cmd = [args.python, "-m", "pytest", "-p", "lmport_adapter", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
               f"--junitxml={work / 'junit.xml'}", *(["-k", args.k] if args.k else []),
               *[f"unit/{f}" for f in files]]
        print("running:", " ".join(shlex.quote(c) for c in cmd), f"(in {suite})", file=sys.stderr)
        subprocess.run(cmd, cwd=suite, env=env, stdout=(work / "pytest.log").open("w"), stderr=subprocess.STDOUT)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rows = results(work / "junit.xml")
    print(table(rows))
    for r in rows:
        if r["outcome"] in ("failed", "error"):
            print(f"- {r['file']}::{r['test']}: {r['message']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "llama_cpp_source": str(source), "files": files,
                                          "rows": rows}, indent=2))
    print(f"wrote {args.out}; pytest log {work / 'pytest.log'}, server log {work / 'server.log'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
