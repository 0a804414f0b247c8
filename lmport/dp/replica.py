"""One data-parallel replica: an engine core (``lmport.engine.core_process``, in a thread beside this) behind the
narrow interface a front end needs.

``submit`` a request (an ``EngineRequest`` packed by ``lmport.engine.messages.pack``), ``abort`` it, ``poll`` for
the outputs of every request since the last poll, ``health`` and ``usage``. Nothing else crosses the boundary, so
the front end (``lmport.dp.frontend``) can sit in front of this in its own process, as a Ray actor
(``lmport.dp.cluster``), or in front of any engine that offers the same five calls. Outputs are the core's deltas,
given their text here by the engine client's output processor (lmport.engine.output_processor), which also ends a
request at a stop string and aborts it in the core: one poll carries each request's new tokens once, and its last
output its whole text.

A request the engine refuses (``RequestError``) or that fails in any other way ends with one error output,
as every request ends: finished, aborted, or with an error.
"""
from __future__ import annotations

import asyncio
import logging

from lmport.config import EngineConfig
from lmport.engine.core import EngineCore
from lmport.engine.outputs import ErrorKind, FinishReason, RequestOutput
from lmport.engine.client import EngineClient
from lmport.engine.messages import EngineRequest, pack, unpack

log = logging.getLogger(__name__)


def error_output(request_id: str, error: str, prompt_tokens: int = 0) -> RequestOutput:
    return RequestOutput(request_id, [], "", [], "", finished=True, finish_reason=FinishReason.ERROR,
                         prompt_tokens=prompt_tokens, error=error, error_kind=ErrorKind.ENGINE)


class Replica:
    """Async methods, all called from one event loop (a Ray async actor's, or the caller's own)."""

    def __init__(self, model: str, config: EngineConfig, index: int = 0):
        self.index = index
        self.engine = EngineCore(model, config)
        self.core = EngineClient.start_thread(self.engine)
        self.outbox: list[RequestOutput] = []
        self.news: asyncio.Event | None = None     # made in the event loop that polls
        self.tasks: dict[str, asyncio.Task] = {}

    def info(self) -> dict:
        """The facts a front end needs before its first request (all replicas of one model agree on them): the
        engine's (an ``EngineInfo``, packed) and the prefix cache's block size and hash seed, for routing."""
        cache = self.engine.block_manager.cache
        return {"engine": pack(self.core.info), "block_size": self.engine.config.block_size,
                "prefix_seed": cache.seed if cache is not None else b""}

    def _event(self) -> asyncio.Event:
        if self.news is None:
            self.news = asyncio.Event()
        return self.news

    def _emit(self, out: RequestOutput) -> None:
        self.outbox.append(out)
        self._event().set()

    async def submit(self, request: bytes) -> None:
        """Starts the request (an ``EngineRequest``, packed) and returns at once; its outputs come through
        ``poll``."""
        engine_request = unpack(request, EngineRequest)
        request_id = engine_request.request_id
        if request_id in self.tasks:
            self._emit(error_output(request_id, f"request id {request_id!r} is already in use",
                                    len(engine_request.prompt_ids)))
            return
        self.tasks[request_id] = asyncio.create_task(self._pump(engine_request))

    async def _pump(self, request: EngineRequest) -> None:
        finished = False
        try:
            async for out in self.core.generate(request):
                finished = out.finished
                self._emit(out)
        except Exception as exc:   # refused (RequestError) or the engine stopped: the request ends with why
            if not finished:
                self._emit(error_output(request.request_id, f"{type(exc).__name__}: {exc}", len(request.prompt_ids)))
        finally:
            self.tasks.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        """The request's last output (finish_reason "abort") still comes through ``poll``."""
        if request_id in self.tasks:
            self.core.abort(request_id)

    async def poll(self, timeout: float = 1.0) -> tuple[list[RequestOutput], str | None, dict]:
        """(outputs since the last poll, why this replica cannot serve or None, its usage); waits up to
        ``timeout`` seconds for the first output."""
        news = self._event()
        if not self.outbox:
            try:
                await asyncio.wait_for(news.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        news.clear()
        outputs, self.outbox = self.outbox, []
        return outputs, self.health(), self.usage()

    def health(self) -> str | None:
        """Why this replica cannot serve (its engine core stopped, a tensor-parallel rank died), else None."""
        return self.core.problem()

    def usage(self) -> dict:
        return dict(self.core.snapshot)

    def close(self) -> None:
        self.core.shutdown()
        self.engine.close()


class ReplicaCalls:
    """A Replica's calls as coroutines, forwarded to ``self.replica``: what the in-process handle and the body of
    a replica's Ray actor (lmport.dp.cluster.ReplicaActor) both offer."""
    replica: Replica

    async def submit(self, request: bytes) -> None:
        await self.replica.submit(request)

    async def abort(self, request_id: str) -> None:
        await self.replica.abort(request_id)

    async def poll(self, timeout: float) -> tuple[list[RequestOutput], str | None, dict]:
        return await self.replica.poll(timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self.replica.close)


class InProcessHandle(ReplicaCalls):
    """A front end's handle on a Replica in its own process (tests, and a cluster-free way to try routing):
    ``restart`` builds the replica anew with ``make``."""

    def __init__(self, make):
        self.make = make
        self.replica = make()

    async def restart(self) -> dict:
        old = self.replica
        await asyncio.to_thread(old.close)
        self.replica = await asyncio.to_thread(self.make)
        return self.replica.usage()
