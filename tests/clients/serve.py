"""`lmport serve smollm2 --port 0` for the client suite, and the address it printed once it listens (the OS picked
the port, so nothing else can take it in between). Standard library only: the runner and the client venvs use it."""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
# lmport serve: MODEL on http://HOST:PORT (session_len ..., ...)
SERVING = re.compile(r"^lmport serve: .* on (http://\S+) \(", re.M)
# A hang guard: start-up imports torch and loads the model, slow on a loaded machine.
START_TIMEOUT_S = 600


def serve_command() -> list[str]:
    """The repository's `lmport` (``LMPORT_CLIENTS_LMPORT`` names another command) serving the default model."""
    command = os.environ.get("LMPORT_CLIENTS_LMPORT", str(ROOT / ".venv" / "bin" / "lmport"))
    return [*command.split(), "serve", MODEL, "--device-type", "cpu", "--port", "0"]


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    # One torch thread unless told otherwise: the model is tiny, and on a shared machine threads wait on each other.
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_command(), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (match := SERVING.search(log.read_text(errors="replace"))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"{' '.join(serve_command())} printed no address:\n{log.read_text()}")
        time.sleep(0.2)
    return proc, match.group(1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
