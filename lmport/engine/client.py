"""The front end's handle on the engine core: send requests, stream their outputs into asyncio.

``EngineClient.start_process(model, config)`` runs the core in its own process (``lmport serve``);
``EngineClient.start_thread(engine)`` runs it in a thread over an engine core the caller built (tests reach into
that core). Either way the two sides exchange the typed messages of ``lmport.engine.messages``: one
request queue, one output queue.

One reader thread receives the core's messages. The core's outputs carry token ids only: the reader gives
them their text with the client's output processor (``lmport.engine.output_processor``: detokenizing, stop strings),
so that work stays off the core's steps, and aborts in the core each request a stop string ended, which its
stream sees finished at once. A step's outputs reach each event loop in one call, which puts each into its
request's asyncio queue. If the core stops for any reason (an exception, the process
killed), every open request gets an error output at once, new requests raise EngineStopped, and
``on_failure`` (if set) is called with the reason. ``snapshot`` is the core's ``EngineCore.usage()`` after its
last step, which /metrics reads without waiting for the engine; ``adapters`` the LoRA adapters it serves,
as the core's replies to ``load_adapter`` and ``unload_adapter`` left them. ``stalled_since`` tells /health how
long the core has had requests and sent nothing back (``lmport.server.liveness``).

The data-parallel front end (``lmport.dp.frontend.DataParallel``) offers the server the same calls.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Protocol

from lmport.config import ConfigError, EngineConfig
from lmport.engine.outputs import ErrorKind, FinishReason, RequestError, RequestOutput
from lmport.engine.messages import (Abort, Add, Call, EngineInfo, EngineRequest, Failed, Outputs, Rejected, Reply,
                                    Shutdown, pack, ready, to_front_end)
from lmport.lora.table import LoadedAdapter
from lmport.engine.output_processor import OutputProcessor

if TYPE_CHECKING:
    from lmport.engine.core import EngineCore
    from lmport.engine.llm import LLM

log = logging.getLogger(__name__)

SHUTDOWN_WAIT = 10.0   # seconds the core may take to stop before it is killed


class EngineStopped(RuntimeError):
    """The engine core is no longer running; no request can be served."""


class EngineHandle(Protocol):
    """What the HTTP front end calls on whatever runs its requests: an EngineClient, or the data-parallel front
    end over several engine cores (lmport.dp.frontend.DataParallel)."""
    info: EngineInfo
    snapshot: dict
    adapters: dict[str, LoadedAdapter]
    on_failure: Callable[[str], None] | None

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    async def load_adapter(self, name: str, path: str) -> LoadedAdapter: ...

    async def unload_adapter(self, name: str) -> LoadedAdapter: ...

    def problem(self) -> str | None: ...

    def shutdown(self) -> None: ...


class EngineClient:
    def __init__(self, info: EngineInfo, usage: dict, adapters: list[LoadedAdapter], send: Callable[[bytes], None],
                 receive: Callable[[], bytes], stop: Callable[[float], None], is_alive: Callable[[], bool],
                 tokenizer):
        """``receive`` blocks for the core's next message and raises EOFError once the core is gone;
        ``stop(timeout)`` waits for the core to end after the shutdown message, and ends it when it does not;
        ``tokenizer``: the model's, for this client alone (the reader thread decodes with it)."""
        self.info = info
        self.snapshot = usage
        self.adapters: dict[str, LoadedAdapter] = {a.name: a for a in adapters}
        self.failure: str | None = None          # why the core stopped, once it has
        self.engine_failure: str | None = None   # what the core reports it cannot run (a tensor-parallel rank)
        self.on_failure: Callable[[str], None] | None = None   # called on the reader thread with the reason
        self._send, self._receive, self._stop, self._is_alive = send, receive, stop, is_alive
        # Each open request's event loop and queue (callers may run different event loops: test clients do).
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}   # control calls waiting
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        # Each open request's output state, used under _lock (the reader processes, generate adds).
        self.outputs = OutputProcessor(tokenizer, cumulative=False)
        # Liveness: the requests the core has not finished, and when it last sent anything (both under _lock).
        self._in_core: set[str] = set()
        self._heard = time.monotonic()
        self._closing = False
        self.process: multiprocessing.process.BaseProcess | None = None   # the core's, when it has its own
        self.tokenizer = None   # the model's, for the caller's own thread (start_process loads one), not the reader's
        self._reader = threading.Thread(target=self._read, name="lmport-engine-outputs", daemon=True)
        self._reader.start()

    # -- starting the core ---------------------------------------------------------------------------------
    @classmethod
    def start_thread(cls, engine: EngineCore | LLM) -> EngineClient:
        """Serve ``engine`` (an in-process LLM serves its core) from a thread of this process."""
        from lmport.engine import core_process as engine_core   # the model code, only where a core runs here
        engine = engine_core.core_of(engine)
        requests: queue.Queue = queue.Queue()
        outputs: queue.Queue = queue.Queue()

        def run():
            engine_core.thread_main(engine, requests, outputs.put)
            outputs.put(None)   # the end: the reader stops

        def receive() -> bytes:
            message = outputs.get()
            if message is None:
                raise EOFError
            return message

        # A copy of the tokenizer: callers may use the engine's on their own threads.
        tokenizer = copy.deepcopy(engine.tokenizer)
        thread = threading.Thread(target=run, name="lmport-engine", daemon=True)
        thread.start()
        return cls(EngineInfo.of(engine), engine.usage(), list(engine.adapters.by_name.values()), requests.put,
                   receive, thread.join, thread.is_alive, tokenizer)

    @classmethod
    def start_process(cls, model: str, config: EngineConfig, loras: dict[str, str] | None = None) -> EngineClient:
        """Start the core process and wait until its engine is built and the LoRA adapters ``loras`` (name ->
        peft directory) are loaded; the client's ``tokenizer`` is the model's, loaded meanwhile. A configuration the
        engine refuses raises ConfigError; any other failure to build it, RuntimeError with the core's reason."""
        # fork: the core inherits the front end's imports (and any patches applied to them) without importing
        # again; the front end has started no thread and touched no device yet.
        from lmport.engine import core_process as engine_core   # imported before the fork, as said
        from lmport.models.loader import load_tokenizer
        context = multiprocessing.get_context("fork")
        core_requests, requests = context.Pipe(duplex=False)   # (reader, writer)
        outputs, core_outputs = context.Pipe(duplex=False)
        process = context.Process(target=engine_core.process_main, name="lmport-engine-core",
                                  args=(model, config, dict(loras or {}), core_requests, core_outputs,
                                        (requests, outputs)))
        process.start()
        core_requests.close()   # the core holds these ends now: its exit closes the output pipe
        core_outputs.close()
        # While the core loads the model: the tokenizer, and the reader thread's own copy of it.
        tokenizer = load_tokenizer(model)
        reader_tokenizer = copy.deepcopy(tokenizer)

        def receive() -> bytes:
            ready = wait([outputs, process.sentinel])
            if outputs in ready:
                try:
                    return outputs.recv_bytes()
                except (EOFError, OSError):
                    pass
            raise EOFError

        try:
            first = ready(receive())
        except Exception:
            process.kill()
            process.join(SHUTDOWN_WAIT)
            raise
        if isinstance(first, Failed):
            process.join(SHUTDOWN_WAIT)
            raise (ConfigError if first.config else RuntimeError)(first.reason)

        # Messages go to the pipe from a thread of their own: a write blocks while the pipe is full (a long prompt
        # sent while the core is in a step), and the event loop that posts them must not.
        outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

        def write() -> None:
            while (data := outbox.get()) is not None:
                try:
                    requests.send_bytes(data)
                except OSError:   # the core is gone; the reader reports why
                    pass
        threading.Thread(target=write, name="lmport-engine-requests", daemon=True).start()

        def stop(timeout: float) -> None:
            outbox.put(None)   # after the shutdown message: the writer ends once it is sent
            process.join(timeout)
            if process.is_alive():
                log.warning("the engine core did not stop within %.0f s; killing it", timeout)
                process.kill()
                process.join(5)

        client = cls(first.info, first.usage, first.adapters, outbox.put, receive, stop, process.is_alive,
                     reader_tokenizer)
        client.process, client.tokenizer = process, tokenizer
        return client

    # -- requests --------------------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (each carries its new tokens and text). A request the core refuses
        raises RequestError (AdapterError for an adapter it does not serve). Closing the iterator early (a client
        that went away) aborts the request."""
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.failure is not None:
                raise EngineStopped(self.failure)
            if request.request_id in self._streams:
                raise RequestError(f"request id {request.request_id!r} is already in use")
            self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
            self.outputs.add(request.request_id, request.gen_config)
            if not self._in_core:   # an idle core owed nothing until now
                self._heard = time.monotonic()
            self._in_core.add(request.request_id)
        self._post(Add(request))
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, Exception):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished and self.failure is None:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Abort at the core's next turn; its last output still reaches an open stream."""
        self._post(Abort(request_id))

    def _post(self, message: Add | Abort | Call | Shutdown) -> None:
        self._send(pack(message))   # a queue's put: the reader thread posts aborts too

    async def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        """Serve the peft adapter at ``path`` (on the core's disk) as ``name``; AdapterError naming the problem."""
        adapter = await self._call("load_adapter", name, path)
        self.adapters[adapter.name] = adapter
        return adapter

    async def unload_adapter(self, name: str) -> LoadedAdapter:
        """New requests for ``name`` are refused from now on; those running finish with it."""
        adapter = await self._call("unload_adapter", name)
        self.adapters.pop(adapter.name, None)
        return adapter

    async def _call(self, name: str, *args: str) -> LoadedAdapter:
        """The core runs ``name`` between steps; its reply's adapter, or its error raised here."""
        done = asyncio.get_running_loop().create_future()
        with self._lock:
            if self.failure is not None:
                raise EngineStopped(self.failure)
            call_id = next(self._call_ids)
            self._calls[call_id] = (asyncio.get_running_loop(), done)
        self._post(Call(call_id, name, list(args)))
        try:
            value, error = await done
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
        if error is not None:
            raise error
        return value

    def stalled_since(self) -> float | None:
        """time.monotonic() of the core's last message while it has unfinished requests; None when it has none
        (an idle core owes no message)."""
        with self._lock:
            return self._heard if self._in_core else None

    def problem(self) -> str | None:
        """Why no request can be served now, or None."""
        if self.failure is not None:
            return self.failure
        if not self._is_alive():
            return "the engine core has stopped"
        if self.engine_failure:
            return f"engine failed: {self.engine_failure}"
        return None

    def shutdown(self) -> None:
        self._closing = True
        self._post(Shutdown())
        self._stop(SHUTDOWN_WAIT)

    # -- the reader thread -----------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = to_front_end(self._receive())
                with self._lock:
                    self._heard = time.monotonic()
                if isinstance(message, Outputs):
                    self.snapshot, self.engine_failure = message.usage, message.failure
                    if message.outputs:
                        with self._lock:
                            core_outputs = [o.output() for o in message.outputs]
                            self._in_core.difference_update(o.request_id for o in core_outputs if o.finished)
                            outputs, ended = self.outputs.process(core_outputs)
                        for out in ended:   # a stop string: the client's request is over, the core's not yet
                            self.abort(out.request_id)
                        self._deliver([(o.request_id, o) for o in outputs])
                elif isinstance(message, Rejected):
                    with self._lock:
                        self.outputs.forget(message.request_id)
                        self._in_core.discard(message.request_id)
                    self._deliver([(message.request_id, message.error.exception())])
                elif isinstance(message, Reply):
                    self._settle(message.call_id,
                                 (message.adapter, None if message.error is None else message.error.exception()))
                elif isinstance(message, Failed):
                    self._fail(message.reason)
                    return
        except EOFError:
            if not self._closing:
                self._fail("the engine core process exited" if self.process is not None else
                           "the engine core has stopped")
        except Exception as exc:  # a message this side cannot read: nothing more can be trusted
            log.exception("reading the engine core's outputs failed")
            self._fail(f"reading the engine core's outputs failed: {type(exc).__name__}: {exc}")

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Put each (request id, output or exception) into its request's queue: one call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item in items:
                if (target := self._streams.get(request_id)) is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:   # that event loop is closed: nobody is waiting
                pass

    def _settle(self, call_id: int, result: tuple) -> None:
        with self._lock:
            target = self._calls.get(call_id)
        if target is not None:
            _call_soon(target[0], _resolve, target[1], result)

    def _fail(self, reason: str) -> None:
        """Every open request ends with an error now; later requests raise EngineStopped."""
        if self.process is not None:
            self.process.join(1)   # its pipe closes just before it exits
            if self.process.exitcode is not None:
                reason = f"{reason} (exit code {self.process.exitcode})"
        log.critical("%s", reason)
        with self._lock:
            self.failure = reason
            request_ids = list(self._streams)
            self.outputs.requests.clear()
            self._in_core.clear()
            calls = list(self._calls)
        for call_id in calls:
            self._settle(call_id, (None, EngineStopped(reason)))
        self._deliver([(request_id, RequestOutput(request_id, [], "", [], "", finished=True,
                                                  finish_reason=FinishReason.ERROR, prompt_tokens=0, error=reason,
                                                  error_kind=ErrorKind.ENGINE)) for request_id in request_ids])
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:
                log.exception("the engine failure handler failed")


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in puts:
        stream.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:   # that event loop is closed: nobody is waiting
        pass


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():   # the caller may have stopped waiting
        future.set_result(result)
