"""A background thread that owns an Engine, for async callers (the server, streaming).

The engine is not thread-safe; every call into it holds ``_lock``. Outputs
reach each caller's asyncio queue through its own event loop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from lmport.config import GenerationConfig
from lmport.engine import Engine, RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stopped = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="lmport-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_ids: list[int], gen_config: GenerationConfig,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Invalid input raises RequestError before anything is queued.

        Closing the iterator early (a client that went away) aborts the request and frees its blocks.
        """
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:
            request_id = self.engine.add_request(prompt_ids, gen_config, request_id)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._work.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)
        self._work.set()

    def call(self, fn, *args, **kwargs):
        """Run ``fn(engine, ...)`` under the engine's lock (stats, tokenizer-free queries)."""
        with self._lock:
            return fn(self.engine, *args, **kwargs)

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished()
                outputs = self.engine.step() if busy else []
                for out in outputs:
                    target = self._streams.get(out.request_id)
                    if target is not None:
                        loop, queue = target
                        loop.call_soon_threadsafe(queue.put_nowait, out)
            if not busy:
                self._work.wait(timeout=0.5)
                self._work.clear()

    def shutdown(self) -> None:
        self._stopped = True
        self._work.set()
        self._thread.join(timeout=10)
        with self._lock:
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)
