"""The data-parallel front end: N replicas behind one request stream, routed by prefix affinity.

``DataParallel`` offers the server the calls of ``lmport.engine.client.EngineClient`` (``info``, ``generate``
an async stream of an ``EngineRequest``'s outputs, ``abort``, ``snapshot`` for /metrics, ``problem``,
``shutdown``; LoRA adapters are served at --dp 1 only), and talks to each replica, itself an engine core,
through the five calls of ``lmport.dp.replica.Replica``: submit, abort, poll, usage (carried by poll) and
health (carried by poll). A handle is anything with those async methods plus ``restart``: a Ray actor
(``lmport.dp.cluster``) or, in tests, a Replica in this process.

The front end runs its own event loop in a thread: one pump a replica polls it for outputs and hands each to
its caller's queue on the caller's event loop. A replica whose poll fails (its actor died) or reports a
problem (its engine failed) is taken out of rotation at once: each of its requests in flight ends with an
error naming the replica, the router forgets its prefixes, and it is restarted while the others keep
serving; once it answers again it is back in rotation. No request is dropped: each ends finished, aborted,
or with an error.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from lmport.dp.replica import error_output
from lmport.dp.router import PrefixRouter
from lmport.engine.outputs import RequestOutput
from lmport.engine.client import EngineStopped
from lmport.engine.messages import EngineInfo, EngineRequest, pack
from lmport.lora import AdapterError
from lmport.lora.table import LoadedAdapter

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5          # a poll returns at once when there are outputs; this bounds an idle one
RESTART_BACKOFF = (0.5, 5.0)   # seconds between tries to reach a restarting replica: first, most


@dataclass
class ReplicaState:
    index: int
    handle: object
    healthy: bool = True
    restarts: int = 0
    last_error: str | None = None
    usage: dict = field(default_factory=dict)
    routed: int = 0                # requests sent to it, ever


def _brief(exc: BaseException) -> str:
    """The exception's type and first line (Ray's errors carry whole tracebacks)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def sum_usage(usages: list[dict]) -> dict:
    """The replicas' usage added up, with the prefix-cache hit rates recomputed from the summed counts."""
    total: dict = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not key.endswith("_rate"):
                total[key] = total.get(key, 0) + value
    for key in ("running", "waiting", "blocks_total", "blocks_used"):
        total.setdefault(key, 0)
    queried = total.get("prefix_cache_queried_blocks", 0)
    device, host = total.get("prefix_cache_hit_blocks_device", 0), total.get("prefix_cache_hit_blocks_host", 0)
    if "prefix_cache_queried_blocks" in total:
        total["prefix_cache_hit_rate"] = (device + host) / queried if queried else 0.0
        total["prefix_cache_device_hit_rate"] = device / queried if queried else 0.0
        total["prefix_cache_host_hit_rate"] = host / queried if queried else 0.0
    return total


class DataParallel:
    def __init__(self, handles: list, router: PrefixRouter, info: EngineInfo, usages: list[dict] | None = None):
        """``info``: one replica's (all replicas of one model and config agree on it)."""
        if len(handles) != router.num_replicas:
            raise ValueError(f"{len(handles)} replica handles for a router of {router.num_replicas}")
        # The server admits as many requests as all replicas run at once.
        self.info = dataclasses.replace(info, max_batch_size=info.max_batch_size * len(handles))
        self.adapters: dict[str, LoadedAdapter] = {}   # LoRA adapters are served at --dp 1 only
        self.router = router
        self.replicas = [ReplicaState(i, h, usage=(usages or [{}] * len(handles))[i]) for i, h in enumerate(handles)]
        self.failure: str | None = None     # the front end itself stopped (never a single replica)
        self.on_failure: Callable[[str], None] | None = None   # never called: a replica's failure is not fatal
        self.snapshot: dict = sum_usage([r.usage for r in self.replicas])
        self.streams: dict[str, tuple[int, asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="lmport-dp", daemon=True)
        self._thread.start()

    # -- the caller's side (any event loop) -------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def problem(self) -> str | None:
        """Why no request can be served now: the front end stopped, or no replica is in rotation."""
        if self.failure is not None:
            return self.failure
        if not any(r.healthy for r in self.replicas):
            return "no data-parallel replica is serving: " + "; ".join(
                f"replica {r.index}: {r.last_error}" for r in self.replicas)
        return None

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request from the replica the router picks (deltas; the last one with the whole text).
        Closing the iterator early aborts the request on its replica."""
        if request.adapter is not None:
            raise _dp1_only()
        if not self.running:
            raise EngineStopped(self.failure or "the data-parallel front end has stopped")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = request.request_id
        started = asyncio.run_coroutine_threadsafe(self._start(request, loop, queue), self.aloop)
        await asyncio.wrap_future(started)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished and self.running:
                self.aloop.call_soon_threadsafe(self._abort, request_id)

    def abort(self, request_id: str) -> None:
        if self.running:
            self.aloop.call_soon_threadsafe(self._abort, request_id)

    async def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        raise _dp1_only()

    async def unload_adapter(self, name: str) -> LoadedAdapter:
        raise _dp1_only()

    def status(self) -> list[dict]:
        """Each replica's health, requests in flight and usage (for /health and /metrics)."""
        return [{"replica": r.index, "healthy": r.healthy, "in_flight": self.router.load[r.index],
                 "routed": r.routed, "restarts": r.restarts, "last_error": r.last_error, "usage": dict(r.usage)}
                for r in self.replicas]

    def shutdown(self) -> None:
        """Ends every request in flight with an error, stops the pumps and closes the replicas."""
        if self._stopped:
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), self.aloop)
        try:
            future.result(timeout=30)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("the data-parallel front end did not shut down within 30 s")
        self._stopped = True
        self.aloop.call_soon_threadsafe(self.aloop.stop)
        self._thread.join(timeout=10)

    # -- the front end's own event loop -------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self.aloop)
        self.pumps = [self.aloop.create_task(self._pump(r)) for r in self.replicas]
        try:
            self.aloop.run_forever()
        except BaseException as exc:  # noqa: BLE001 - whatever stops the loop must reach every caller
            self.failure = f"the data-parallel front end stopped: {type(exc).__name__}: {exc}"
            log.critical("%s", self.failure, exc_info=True)

    async def _start(self, request: EngineRequest, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        request_id = request.request_id
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            route = self.router.choose(request.prompt_ids, request.cache_salt)
        except ValueError:
            raise EngineStopped(self.problem() or "no data-parallel replica is serving") from None
        replica = self.replicas[route.replica]
        replica.routed += 1
        self.router.started(replica.index)
        self.streams[request_id] = (replica.index, loop, queue)
        try:
            await replica.handle.submit(pack(request))
        except Exception as exc:
            self._replica_failed(replica, _brief(exc))

    def _deliver(self, out: RequestOutput) -> None:
        entry = self.streams.get(out.request_id)
        if entry is None:   # its caller has left (the abort's own last output), or it was ended already
            return
        index, loop, queue = entry
        if out.finished:
            del self.streams[out.request_id]
            self.router.finished(index)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:   # that caller's event loop is closed: nobody is waiting
            pass

    def _abort(self, request_id: str) -> None:
        entry = self.streams.pop(request_id, None)
        if entry is None:
            return
        index = entry[0]
        self.router.finished(index)
        replica = self.replicas[index]
        if replica.healthy:
            self.aloop.create_task(self._quietly(replica.handle.abort(request_id)))

    @staticmethod
    async def _quietly(call) -> None:
        try:
            await call
        except Exception:   # the replica is gone; its pump notices and restarts it
            pass

    async def _pump(self, replica: ReplicaState) -> None:
        """Polls one replica for ever: its outputs to their callers; a failure takes it out and restarts it."""
        while not self._stopped:
            try:
                outputs, problem, usage = await replica.handle.poll(POLL_SECONDS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                problem, outputs, usage = _brief(exc), [], None
            for out in outputs:
                if out.error is not None:   # the caller learns which replica failed its request
                    out.error = f"data-parallel replica {replica.index}: {out.error}"
                self._deliver(out)
            if usage is not None:
                replica.usage = usage
                self.snapshot = sum_usage([r.usage for r in self.replicas if r.healthy])
            if problem is not None:
                self._replica_failed(replica, problem)
                await self._restart(replica)

    def _replica_failed(self, replica: ReplicaState, why: str) -> None:
        """Out of rotation; each of its requests in flight ends with an error naming it."""
        if not replica.healthy:
            return
        replica.healthy, replica.last_error = False, why
        self.router.set_healthy(replica.index, False)
        self.snapshot = sum_usage([r.usage for r in self.replicas if r.healthy])
        lost = [rid for rid, (index, _, _) in self.streams.items() if index == replica.index]
        log.error("data-parallel replica %d failed (%s): ending its %d request(s) in flight, restarting it",
                  replica.index, why, len(lost))
        for rid in lost:
            self._deliver(error_output(rid, f"data-parallel replica {replica.index} failed: {why}"))

    async def _restart(self, replica: ReplicaState) -> None:
        """Until the replica answers again (a Ray actor is restarted by Ray: its engine loads anew)."""
        delay = RESTART_BACKOFF[0]
        while not self._stopped:
            try:
                usage = await replica.handle.restart()
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("data-parallel replica %d is not back yet (%s); trying again in %.1f s",
                         replica.index, _brief(exc), delay)
                await asyncio.sleep(delay)
                delay = min(RESTART_BACKOFF[1], delay * 2)
        else:
            return
        replica.restarts += 1
        replica.usage = usage
        replica.healthy = True
        self.router.set_healthy(replica.index, True)
        log.warning("data-parallel replica %d is back in rotation (restart %d)", replica.index, replica.restarts)

    async def _shutdown(self) -> None:
        for rid in list(self.streams):
            self._deliver(error_output(rid, "the server is shutting down"))
        self._stopped = True
        for pump in self.pumps:
            pump.cancel()
        await asyncio.gather(*self.pumps, return_exceptions=True)
        for replica in self.replicas:
            try:
                await replica.handle.close()
            except Exception as exc:
                log.warning("closing data-parallel replica %d: %s", replica.index, exc)


def _dp1_only() -> AdapterError:
    return AdapterError("LoRA adapters are served with --dp 1 only; start the server without --dp to use them",
                        "model", 400)
