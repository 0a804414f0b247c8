"""A background thread that owns an Engine, for async callers (the server, streaming).

The engine is not thread-safe; every call into it holds ``_lock``. Outputs
reach each caller's asyncio queue through its own event loop. Adds and
aborts from async callers are queued for the engine thread (``_submit``)
instead of waiting for the lock, which a running step holds.

If the engine thread stops for any reason, every waiting and streaming caller
gets an error output at once, new calls raise EngineStopped, and
``on_failure`` (if given) is called with the reason. After each step the
thread publishes ``snapshot`` (engine.usage()), which readers such as
/metrics use without waiting for the engine.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from collections.abc import AsyncIterator

from lmport.config import GenerationConfig
from lmport.engine import Engine, RequestOutput

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine thread is no longer running; no request can be served."""


class EngineLoop:
    def __init__(self, engine: Engine, on_failure=None):
        self.engine = engine
        self.on_failure = on_failure       # called (on the engine thread) with the reason it stopped
        self.failure: str | None = None    # why the engine thread stopped, once it has
        self.snapshot: dict = engine.usage()
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stopped = False
        # Guards failure, _streams and _adding between the engine thread and the callers.
        self._state = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._adding: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._runs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}   # run() calls waiting
        self._inbox: collections.deque = collections.deque()  # calls for the engine thread (see _submit)
        self._thread = threading.Thread(target=self._run, name="lmport-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_ids: list[int], gen_config: GenerationConfig,
                       request_id: str | None = None, cache_salt: str | None = None,
                       adapter: str | None = None, pooling: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Invalid input raises RequestError before anything is queued.
        ``cache_salt``: only requests with the same salt share prefix-cache blocks; ``adapter``: the LoRA
        adapter to run it with (AdapterError when none of that name is loaded); ``pooling``: an embedding request
        (Engine.add_request).

        Closing the iterator early (a client that went away) aborts the request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        added = loop.create_future()  # resolves to None, or to the RequestError add_request raised
        request_id = request_id if request_id is not None else f"loop-{uuid.uuid4().hex}"

        def add(engine):
            try:
                engine.add_request(prompt_ids, gen_config, request_id, cache_salt=cache_salt, adapter=adapter,
                                   pooling=pooling)
                error = None
            except Exception as exc:
                error = exc
            with self._state:
                self._adding.pop(request_id, None)
                if error is None:
                    self._streams[request_id] = (loop, queue)
            loop.call_soon_threadsafe(_resolve, added, error)

        with self._state:
            if self.failure is not None:
                raise EngineStopped(self.failure)
            self._adding[request_id] = (loop, added)
        # Queued for the engine thread, not added under the lock: waiting for the lock here
        # would stall this event loop (every other stream) until the running step ends.
        self._submit(add)
        finished = False
        try:
            error = await added
            if error is not None:
                finished = True  # nothing was queued
                raise error
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished and self.failure is None:  # runs after add() on the engine thread
                self._submit(lambda engine: (engine.abort(request_id), self._forget(request_id)))
            else:
                self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        with self._state:
            self._streams.pop(request_id, None)
            self._adding.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort at the engine thread's next turn; its last output still reaches an open stream."""
        self._submit(lambda engine: engine.abort(request_id))

    def submit(self, fn) -> None:
        """Run ``fn(engine)`` on the engine thread before its next step; never waits."""
        self._submit(fn)

    def _submit(self, fn) -> None:
        """Run ``fn(engine)`` on the engine thread before its next step, in submission order."""
        self._inbox.append(fn)
        self._work.set()

    async def run(self, fn):
        """``fn(engine)`` on the engine thread between steps (as adds and aborts are); its result or exception.

        Unlike call(), no thread waits for the lock; a caller that stops waiting leaves ``fn`` to run anyway.
        """
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def work(engine):
            try:
                result = (fn(engine), None)
            except Exception as exc:
                result = (None, exc)
            _call_soon(loop, _settle, done, result)

        with self._state:
            if self.failure is not None:
                raise EngineStopped(self.failure)
            self._runs[id(done)] = (loop, done)
        self._submit(work)
        try:
            value, error = await done
        finally:
            with self._state:
                self._runs.pop(id(done), None)
        if error is not None:
            raise error
        return value

    def call(self, fn, *args, **kwargs):
        """Run ``fn(engine, ...)`` under the engine's lock (stats, tokenizer-free queries)."""
        with self._lock:
            return fn(self.engine, *args, **kwargs)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - whatever stops the thread must reach every caller
            log.critical("the engine thread stopped: %s: %s", type(exc).__name__, exc, exc_info=True)
            self._fail(f"the engine stopped: {type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        while not self._stopped:
            with self._lock:
                while self._inbox:
                    try:
                        self._inbox.popleft()(self.engine)
                    except Exception:  # one bad call must not stop the loop for every request
                        log.exception("engine call failed")
                busy = self.engine.has_unfinished()
                outputs = self.engine.step() if busy else []
                self.snapshot = self.engine.usage()
                with self._state:
                    targets = [(self._streams.get(out.request_id), out) for out in outputs]
                for target, out in targets:
                    if target is not None:
                        loop, queue = target
                        loop.call_soon_threadsafe(queue.put_nowait, out)
            if not busy:
                self._work.wait(timeout=0.5)
                self._work.clear()

    def _fail(self, reason: str) -> None:
        """Every caller gets an error now; later calls raise EngineStopped."""
        with self._state:
            self.failure = reason
            streams, self._streams = self._streams, {}
            adding, self._adding = self._adding, {}
            runs, self._runs = self._runs, {}
        for request_id, (loop, queue) in streams.items():
            out = RequestOutput(request_id, [], "", [], "", finished=True, finish_reason="error", prompt_tokens=0,
                                error=reason)
            _call_soon(loop, queue.put_nowait, out)
        for loop, future in adding.values():
            _call_soon(loop, _resolve, future, EngineStopped(reason))
        for loop, future in runs.values():
            _call_soon(loop, _settle, future, (None, EngineStopped(reason)))
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:
                log.exception("the engine failure handler failed")

    def shutdown(self) -> None:
        self._stopped = True
        self._work.set()
        self._thread.join(timeout=10)
        with self._lock:
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that caller's event loop is closed: nobody is waiting
        pass


def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():  # the waiting generator may have been closed meanwhile
        future.set_result(error)


def _settle(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)
