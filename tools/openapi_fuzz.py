"""schemathesis against `lmport serve`'s own /openapi.json: every route, every check, bounded examples.

Starts `lmport serve` (by default on the tiny random-weight Qwen2 test model, whose template has tools and
special tokens) on a free 127.0.0.1 port and runs the schemathesis command line against the document the
server publishes. schemathesis lives in its own virtualenv (its dependencies must not change lmport's): the
one at --schemathesis or $LMPORT_SCHEMATHESIS (a schemathesis executable), else one this script makes on first
use under ~/.cache/lmport-tests/ ($XDG_CACHE_HOME when set) with `python -m venv` and pip, at the pinned
release (SCHEMATHESIS below):

    .venv/bin/python tools/openapi_fuzz.py                       # 40 examples an operation
    .venv/bin/python tools/openapi_fuzz.py --max-examples 200

Exits with schemathesis's status (0: no failure); its summary is printed and a JUnit report is written to
tools/results/openapi_fuzz.xml.

Every check runs. One is configured: ``positive_data_acceptance`` also accepts 400 (besides its defaults),
because some rules of a valid request cannot be stated in JSON Schema and are checked by the server with a
400 naming the field: a ``guided_grammar`` / ``guided_regex`` must compile, a ``guided_json`` or tool
``parameters`` must be a JSON Schema xgrammar enforces, a ``tool_choice`` must name one of the given
``tools``. What the document can state, it states (a tool message's ``tool_call_id``, non-empty grammars,
unsupported fields as null only), and 5xx, hangs and response-schema violations are never accepted.
``max_response_time`` is 60 s, the server's --request-timeout here (a shared CPU generates slowly).
schemathesis runs with a raised recursion limit: on Python 3.11 its coverage phase otherwise hits
"AST constructor recursion depth mismatch" describing deeply nested strategies (a tool-side error).
"""
from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe import start_server  # noqa: E402

from lmport.bench.client import served_url, wait_ready  # noqa: E402

# Pinned: a new release adds checks, and an unchanged tree must give the same result on every machine.
SCHEMATHESIS = "schemathesis==4.32.5"


def tool_venv() -> Path:
    """Where the pinned schemathesis is installed on first use."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "lmport-tests" / SCHEMATHESIS.replace("==", "-")


def install_schemathesis(venv: Path) -> Path:
    """``venv``'s schemathesis executable, made first where it is not there yet. One install at a time: a
    concurrent run waits on the lock, then finds it done."""
    done = venv / ".installed"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(venv, ignore_errors=True)   # what an interrupted install left
            print(f"installing {SCHEMATHESIS} into {venv}", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", SCHEMATHESIS], check=True)
            done.touch()
    return venv / "bin" / "schemathesis"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="served model (default: the tiny tool-template test model)")
    parser.add_argument("--max-examples", type=int, default=40, help="examples per operation and phase")
    parser.add_argument("--schemathesis", default=os.environ.get("LMPORT_SCHEMATHESIS"),
                        help="a schemathesis executable in its own virtualenv (default: $LMPORT_SCHEMATHESIS, else "
                             f"{SCHEMATHESIS} installed under {tool_venv()} on first use)")
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--server-args", default="--session-len 128 --cache-max-entry-count 128 --max-batch-size 16 "
                                                 "--request-timeout 60",
                        help="extra `lmport serve` flags (a small session bounds every generation)")
    args = parser.parse_args(argv)
    if args.schemathesis is None:
        args.schemathesis = str(install_schemathesis(tool_venv()))
    elif not Path(args.schemathesis).exists():
        print(f"schemathesis not found at {args.schemathesis} (--schemathesis or $LMPORT_SCHEMATHESIS); leave both "
              f"out to install it under {tool_venv()}", file=sys.stderr)
        return 2
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from support.model_helpers import tiny_tool_model_dir
        args.model = tiny_tool_model_dir()
    log = Path(tempfile.mkdtemp(prefix="lmport-openapi-fuzz-")) / "server.log"
    proc = start_server(args.model, args.server_args.split(), log, threads=None)
    try:
        url = served_url(proc, log, time.monotonic() + 300)
        asyncio.run(wait_ready(url, proc, time.monotonic() + 300))
        results = ROOT / "tools" / "results"
        results.mkdir(parents=True, exist_ok=True)
        config = log.parent / "schemathesis.toml"
        # Responses may take up to the server's --request-timeout (60 s): a shared CPU generates slowly.
        config.write_text('[checks]\nmax_response_time = 60\n\n[checks.positive_data_acceptance]\n'
                          'expected-statuses = ["2XX", "3XX", "400", "401", "403", "404", "409", "429", "5XX"]\n')
        python = Path(args.schemathesis).parent / "python"
        launcher = ("import sys; sys.setrecursionlimit(20000); sys.argv[0] = 'schemathesis'; "
                    "from schemathesis.cli import schemathesis; sys.exit(schemathesis())")
        cmd = [str(python), "-c", launcher, "--config-file", str(config), "run", f"{url}/openapi.json",
               "--checks", "all", "--max-examples",
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
