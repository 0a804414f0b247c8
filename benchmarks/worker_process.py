"""A benchmark's engine in a process of its own, kept across rounds: it prints a JSON line once it is loaded
and warm, then one a round, for each "round" line it reads."""
from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path


class WorkerProcess:
    def __init__(self, argv: list[str], env: Mapping[str, str] | None = None, cwd: Path | None = None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd)
        self.info = self._read()   # sent once the engine is loaded and warm

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a benchmark worker died (exit {self.proc.wait()}); its error is above")
        return json.loads(line)

    def round(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def step(engine) -> None:
    """One step of a worker's engine. A request it ended with an error (a kernel build that refuses this
    checkout's cache, say) ends the worker: a round timed over a failure would print a figure of nothing."""
    for out in engine.step():
        if out.error:
            raise SystemExit(f"the engine ended a request with an error: {out.error}")
