"""LoRA adapter files read off the engine core's step loop.

Reading and checking an adapter (``Engine.read_adapter``) touches files a client named: a slow disk, a huge
file or a path that blocks must not hold the steps of every running request. Each read runs on a thread of its
own; the core looks for finished reads between steps and only then loads the weights (``Engine.load_adapter``).
A read not finished within ``timeout`` is answered with an error (its thread is left to end on its own), and at
most ``limit`` reads run at once, those left behind included.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lmport.lora import AdapterError

log = logging.getLogger(__name__)

READ_TIMEOUT = 60.0   # seconds a read may take before its load is refused
MAX_READS = 4         # reads at once, stuck ones included


class AdapterReads:
    def __init__(self, read: Callable[[str], object], timeout: float = READ_TIMEOUT, limit: int = MAX_READS):
        self._read, self.timeout, self.limit = read, timeout, limit
        self._lock = threading.Lock()
        self._running: dict[object, dict] = {}   # key -> {"args", "started", "result" | "error", "abandoned"}

    def busy(self) -> bool:
        with self._lock:
            return any(not r.get("abandoned") for r in self._running.values())

    def start(self, key, name: str, path: str) -> None:
        """Read ``path`` on a thread; ``finished()`` gives it back under ``key``. AdapterError when too many
        reads are running."""
        with self._lock:
            if len(self._running) >= self.limit:
                raise AdapterError("lora_path: the adapter could not be loaded: too many adapter loads are in "
                                   "progress; retry later", param="lora_path", status=409)
            entry = self._running[key] = {"args": (name, path), "started": time.monotonic()}
        threading.Thread(target=self._run, args=(key, entry, path), name="lmport-adapter-read", daemon=True).start()

    def _run(self, key, entry: dict, path: str) -> None:
        try:
            outcome = {"result": self._read(path)}
        except Exception as exc:  # noqa: BLE001 - handed to the core, which replies with it
            outcome = {"error": exc}
        with self._lock:
            if entry.get("abandoned"):   # already answered: the slot is free again
                self._running.pop(key, None)
            else:
                entry.update(outcome)

    def finished(self) -> list[tuple[object, tuple[str, str], object, Exception | None]]:
        """(key, (name, path), adapter or None, error or None) of each read that ended or ran out of time."""
        done, now = [], time.monotonic()
        with self._lock:
            for key, entry in list(self._running.items()):
                if entry.get("abandoned"):
                    continue
                if "result" in entry or "error" in entry:
                    del self._running[key]
                    done.append((key, entry["args"], entry.get("result"), entry.get("error")))
                elif now - entry["started"] > self.timeout:
                    entry["abandoned"] = True   # its thread removes it when the read ends
                    log.warning("reading the LoRA adapter at %s took longer than %.0f s; its load is refused",
                                entry["args"][1], self.timeout)
                    done.append((key, entry["args"], None, AdapterError(
                        f"lora_path: the adapter could not be loaded: reading it took longer than {self.timeout:g} s",
                        param="lora_path")))
        return done
