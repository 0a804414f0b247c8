"""`lmport serve` in a subprocess, on a port the OS picks (``--port 0``): the address comes from the line the
command prints once it listens, so no other process can take the port between choosing it and binding it."""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx

# lmport serve: MODEL on http://HOST:PORT (session_len ..., ...)
SERVING = re.compile(r"^lmport serve: .* on (http://\S+) \(", re.M)


def wait_for_line(proc: subprocess.Popen, log: Path, pattern: re.Pattern, timeout: float = 300) -> re.Match:
    """The first match of ``pattern`` in ``log`` (the output of ``proc``); fails, showing the log, when the process
    exits first or ``timeout`` seconds pass (a hang guard: start-up on a loaded machine takes long)."""
    deadline = time.monotonic() + timeout
    while (match := pattern.search(log.read_text(errors="replace"))) is None:
        assert proc.poll() is None, f"{proc.args[:4]} exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{proc.args[:4]} printed nothing matching {pattern.pattern}:\n" \
                                            f"{log.read_text()}"
        time.sleep(0.1)
    return match


class ServeProcess:
    """``command serve argv --port 0``, its output in ``log``; ``command`` is the `lmport` command, or a script
    that hands its arguments to lmport.entrypoints.cli.main."""

    def __init__(self, command: list[str], argv: list[str], log: Path, env: dict | None = None):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([*command, "serve", *argv, "--port", "0"], stdout=out,
                                         stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))
        self.url: str | None = None
        self.port: int | None = None

    def ready(self, headers: dict | None = None) -> ServeProcess:
        """Waits for the address line, then for /health (the server listens from that line on)."""
        if self.url is None:
            self.url = wait_for_line(self.proc, self.log, SERVING).group(1)
            self.port = int(self.url.rpartition(":")[2])
            try:
                health = httpx.get(self.url + "/health", headers=headers, timeout=120)
            except httpx.TransportError as exc:
                raise AssertionError(f"{self.url}/health: {exc}\n{self.log.read_text()}") from None
            assert health.status_code == 200, f"{health.text}\n{self.log.read_text()}"
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
