"""schemathesis against `lmport serve`'s own /openapi.json: every route, every check, bounded examples.

Starts `lmport serve` (by default on the tiny random-weight Qwen2 test model, whose template has tools and
special tokens) on a free 127.0.0.1 port and runs the schemathesis command line against the document the
server publishes. schemathesis lives in its own environment (it must not change lmport's), found at
--schemathesis or $LMPORT_SCHEMATHESIS, else /root/.venvs/outside/bin/schemathesis:

    python3 -m venv /root/.venvs/outside && /root/.venvs/outside/bin/pip install schemathesis
    .venv/bin/python benchmarks/openapi_fuzz.py                       # 40 examples an operation
    .venv/bin/python benchmarks/openapi_fuzz.py --max-examples 200

Exits with schemathesis's status (0: no failure); its summary is printed and a JUnit report is written to
benchmarks/results/openapi_fuzz.xml.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_loopback_port, start_server, wait_ready  # noqa: E402

DEFAULT_SCHEMATHESIS = "/root/.venvs/outside/bin/schemathesis"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="served model (default: the tiny tool-template test model)")
    parser.add_argument("--max-examples", type=int, default=40, help="examples per operation and phase")
    parser.add_argument("--schemathesis", default=os.environ.get("LMPORT_SCHEMATHESIS", DEFAULT_SCHEMATHESIS))
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--server-args", default="--session-len 256 --cache-max-entry-count 128 --max-batch-size 16 "
                                                 "--request-timeout 60",
                        help="extra `lmport serve` flags (a small session bounds every generation)")
    args = parser.parse_args(argv)
    if not Path(args.schemathesis).exists():
        print(f"schemathesis not found at {args.schemathesis}: install it in its own environment (see the "
              f"docstring) or pass --schemathesis", file=sys.stderr)
        return 2
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from models import tiny_tool_model_dir
        args.model = tiny_tool_model_dir()
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="lmport-openapi-fuzz-")) / "server.log"
    proc = start_server(args.model, port, args.server_args.split(), log, threads=None)
    try:
        asyncio.run(wait_ready(url, proc, time.monotonic() + 300))
        results = ROOT / "benchmarks" / "results"
        results.mkdir(parents=True, exist_ok=True)
        cmd = [args.schemathesis, "run", f"{url}/openapi.json", "--checks", "all", "--max-examples",
               str(args.max_examples), "--seed", str(args.seed), "--workers", "2", "--request-timeout", "120",
               "--continue-on-failure", "--report", "junit", "--report-junit-path", str(results / "openapi_fuzz.xml")]
        print("running:", " ".join(cmd), file=sys.stderr)
        code = subprocess.run(cmd, env={**os.environ, "NO_COLOR": "1"}).returncode
        if proc.poll() is not None:
            print(f"the server exited ({proc.returncode}); its log:\n{log.read_text()[-4000:]}", file=sys.stderr)
            return 1
        return code
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
