"""The engine core's loop: requests in from one queue, one batch of outputs out a step on another.

``serve`` runs an EngineCore (scheduler, block manager, executor, sampling) for the HTTP front end, either in
its own process (``lmport serve``: ``process_main``, so that the engine's Python and the front end's event
loop, tokenizing and SSE formatting do not share one interpreter lock) or in a thread of the front end's
process (tests that reach into the core; a data-parallel replica, ``lmport.dp.replica``). The messages
are ``lmport.engine.messages``: msgpack bytes, the same in both.

Between steps the core takes every message waiting (adds, aborts, control calls such as loading a LoRA
adapter) in arrival order; it steps while any request is unfinished, and waits for a message otherwise; a
wait of ``IDLE_WAIT`` with nothing after steps hands the backend's kept step memory back to the system
(``Backend.release_idle_memory``: a server's memory comes back when it is idle). A LoRA
load reads its files on a thread of its own (``lmport.lora.reads``) and copies the weights in between two steps
once read, so no file a client names can hold the steps. An
exception out of a step stops the core: the front end is told why (``Failed``) and fails every
open request with that reason.
"""
from __future__ import annotations

import logging
import queue
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from lmport.config import ConfigError, EngineConfig
from lmport.engine.core import EngineCore
from lmport.engine.llm import LLM
from lmport.engine.outputs import RequestError
from lmport.engine.messages import (CALLS, PROTOCOL, Abort, Add, Call, EngineInfo, Failed, OutputDelta, Outputs,
                                    Ready, Rejected, Reply, Shutdown, WireError, pack, to_core)
from lmport.lora import AdapterError
from lmport.lora.reads import AdapterReads

log = logging.getLogger(__name__)

IDLE_WAIT = 0.5   # seconds the idle core waits for a message before looking again
READ_POLL = 0.02  # ... and while an adapter is being read, so that its load is answered promptly

Receive = Callable[[float | None], "bytes | None"]   # a message, or None when none came within the timeout
Send = Callable[[bytes], None]


class Stop(Exception):
    """The front end asked the core to stop, or went away."""


def core_of(engine: EngineCore | LLM) -> EngineCore:
    """The core an engine serves: an in-process LLM's own (its outputs of token ids: the front end decodes them)."""
    return engine.core if isinstance(engine, LLM) else engine


def serve(engine: EngineCore, receive: Receive, send: Send) -> None:
    """Run ``engine`` for the front end until it asks for shutdown (or its queue closes)."""
    usage_sent = None
    reads = AdapterReads(engine.read_adapter)
    stepped = False   # whether steps ran since the backend last gave back the memory it keeps for them
    try:
        while True:
            wait = 0.0 if engine.has_unfinished() else READ_POLL if reads.busy() else IDLE_WAIT
            message = receive(wait)
            if message is None and wait == IDLE_WAIT and stepped:   # a whole wait with nothing to do
                engine.backend.release_idle_memory()
                stepped = False
            while message is not None:
                _handle(engine, message, send, reads)
                message = receive(0.0)
            _finish_loads(engine, reads, send)
            if not engine.has_unfinished():
                usage = engine.usage()
                if usage != usage_sent:   # the last step's counters, once the core goes idle
                    send(pack(Outputs([], usage, engine.failure)))
                    usage_sent = usage
                continue
            outputs = engine.step()
            stepped = True
            usage_sent = engine.usage()
            send(pack(Outputs([OutputDelta.of(o) for o in outputs], usage_sent, engine.failure)))
    except Stop:
        for request_id in list(engine.seqs):
            engine.abort(request_id)


def _handle(engine: EngineCore, data: bytes, send: Send, reads: AdapterReads) -> None:
    try:
        message = to_core(data)
    except msgspec.DecodeError as exc:   # a front end of another version, or a bug: that message alone is lost
        log.error("a message from the front end could not be read: %s", exc)
        return
    if isinstance(message, Add):
        request = message.request
        try:
            engine.add_request(request.prompt_ids, request.gen_config, request.request_id,
                               cache_salt=request.cache_salt, adapter=request.adapter, pooling=request.pooling,
                               images=request.images, group=request.group)
        except Exception as exc:   # refused (RequestError, AdapterError) or unexpected: that request fails
            if not isinstance(exc, (RequestError, AdapterError)):
                log.exception("adding request %s failed", request.request_id)
            send(pack(Rejected(request.request_id, WireError.of(exc))))
    elif isinstance(message, Abort):
        engine.abort(message.request_id)
    elif isinstance(message, Call):
        call_id, name, args = message.call_id, message.name, message.args
        try:
            if name not in CALLS:
                raise RequestError(f"unknown engine call {name!r}")
            if name == "load_adapter":   # answered by _finish_loads once its files are read
                engine.adapters.check_name(args[0])   # a name in use is refused before any file is read
                reads.start(call_id, *args)
                return
            send(pack(Reply(call_id, getattr(engine, name)(*args), None)))
        except Exception as exc:   # the caller's error, never the core's
            if not isinstance(exc, (RequestError, AdapterError)):
                log.exception("engine call %s failed", name)
            send(pack(Reply(call_id, None, WireError.of(exc))))
    elif isinstance(message, Shutdown):
        raise Stop


def _finish_loads(engine: EngineCore, reads: AdapterReads, send: Send) -> None:
    """Load each adapter whose read has ended (between steps: the weights go into the engine's slots)."""
    for call_id, (name, path), adapter, error in reads.finished():
        try:
            if error is not None:
                raise error
            send(pack(Reply(call_id, engine.load_adapter(name, path, adapter), None)))
        except Exception as exc:
            if not isinstance(exc, (RequestError, AdapterError)):   # the details stay in the server's log
                log.error("loading the LoRA adapter %r from %s failed", name, path, exc_info=exc)
                exc = AdapterError("lora_path: the adapter could not be loaded", param="lora_path")
            send(pack(Reply(call_id, None, WireError.of(exc))))


def failure_reason(exc: BaseException) -> str:
    return f"the engine stopped: {type(exc).__name__}: {exc}"


# -- in a thread of the front end's process --------------------------------------------------------------
def thread_main(engine: EngineCore, requests: queue.Queue, send: Send) -> None:
    def receive(timeout: float | None) -> bytes | None:
        try:
            return requests.get(timeout=timeout) if timeout else requests.get_nowait()
        except queue.Empty:
            return None

    try:
        serve(engine, receive, send)
    except BaseException as exc:  # noqa: BLE001 - whatever stops the core must reach every caller
        log.critical("%s", failure_reason(exc), exc_info=True)
        send(pack(Failed(failure_reason(exc))))


# -- in its own process ------------------------------------------------------------------------------------
def load_adapters(engine: EngineCore, loras: dict[str, str]) -> None:
    """The LoRA adapters named at start (NAME -> peft directory); ConfigError naming the one that fails."""
    for name, path in loras.items():
        if name == engine.model_name:
            raise ConfigError(f"--lora {name}={path}: the name is the base model's; choose another")
        try:
            engine.load_adapter(name, path)
        except AdapterError as exc:
            raise ConfigError(f"--lora {name}={path}: {exc}") from None


def ready_message(engine: EngineCore) -> bytes:
    return pack(Ready(PROTOCOL, EngineInfo.of(engine), engine.usage(), list(engine.adapters.by_name.values())))


def process_main(model: str, config: EngineConfig, loras: dict[str, str], requests: Connection,
                 outputs: Connection, parent_ends: tuple[Connection, ...]) -> None:
    """The engine core process: build the engine (and load ``loras``), say it is ready (or why not), serve
    until told to stop."""
    for end in parent_ends:   # inherited from the front end; only its own copies may keep the pipes open
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the front end, which shuts the core down

    def send(data: bytes) -> None:
        outputs.send_bytes(data)

    def receive(timeout: float | None) -> bytes | None:
        try:
            if not requests.poll(timeout):
                return None
            return requests.recv_bytes()
        except (EOFError, OSError):   # the front end is gone
            raise Stop from None

    engine = None
    try:
        engine = EngineCore(model, config)
        load_adapters(engine, loras)
    except BaseException as exc:  # noqa: BLE001 - the front end reports it and exits
        if isinstance(exc, ConfigError):   # the front end reports it as it would its own
            send(pack(Failed(str(exc), config=True)))
        else:
            log.critical("the engine could not start: %s: %s", type(exc).__name__, exc, exc_info=True)
            send(pack(Failed(f"the engine could not start: {type(exc).__name__}: {exc}")))
        if engine is not None:
            engine.close()
        return
    try:
        send(ready_message(engine))
        serve(engine, receive, send)
    except BaseException as exc:  # noqa: BLE001
        log.critical("%s", failure_reason(exc), exc_info=True)
        try:
            send(pack(Failed(failure_reason(exc))))
        except OSError:
            pass
    finally:
        engine.close()
