"""One data-parallel replica: an Engine behind the narrow interface a front end needs.

``submit`` a request, ``abort`` it, ``poll`` for the outputs of every request since the last poll, ``health``
and ``usage``. Nothing else crosses the boundary, so the front end (``lmport.dp.frontend``) can sit in front of
this in its own process, as a Ray actor (``lmport.dp.cluster``), or in front of any engine that offers the
same five calls. Outputs are deltas (``Engine.output_deltas``): one poll carries each request's new tokens
once, and its last output carries everything.

A request the engine refuses (``RequestError``) or that fails in any other way ends with one error output,
as every request ends: finished, aborted, or with an error.
"""
from __future__ import annotations

import asyncio
import logging

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine import Engine, RequestOutput
from lmport.engine_loop import EngineLoop

log = logging.getLogger(__name__)


def error_output(request_id: str, error: str, prompt_tokens: int = 0) -> RequestOutput:
    return RequestOutput(request_id, [], "", [], "", finished=True, finish_reason="error",
                         prompt_tokens=prompt_tokens, error=error)


class Replica:
    """Async methods, all called from one event loop (a Ray async actor's, or the caller's own)."""

    def __init__(self, model: str, config: EngineConfig, index: int = 0):
        self.index = index
        self.engine = Engine(model, config)
        self.engine.output_deltas = True
        self.loop = EngineLoop(self.engine)
        self.outbox: list[RequestOutput] = []
        self.news: asyncio.Event | None = None     # made in the event loop that polls
        self.tasks: dict[str, asyncio.Task] = {}

    def info(self) -> dict:
        """The facts a front end needs before its first request (all replicas of one model agree on them)."""
        e = self.engine
        cache = e.block_manager.cache
        return {"session_len": e.session_len, "num_blocks": e.plan.num_blocks, "block_size": e.config.block_size,
                "eos_token_ids": list(e.eos_token_ids), "prefix_seed": cache.seed if cache is not None else b"",
                "config": e.config}

    def _event(self) -> asyncio.Event:
        if self.news is None:
            self.news = asyncio.Event()
        return self.news

    def _emit(self, out: RequestOutput) -> None:
        self.outbox.append(out)
        self._event().set()

    async def submit(self, request_id: str, prompt_ids: list[int], gen_config: GenerationConfig,
                     cache_salt: str | None = None) -> None:
        """Starts the request and returns at once; its outputs come through ``poll``."""
        if request_id in self.tasks:
            self._emit(error_output(request_id, f"request id {request_id!r} is already in use", len(prompt_ids)))
            return
        self.tasks[request_id] = asyncio.create_task(self._pump(request_id, prompt_ids, gen_config, cache_salt))

    async def _pump(self, request_id: str, prompt_ids: list[int], gen_config: GenerationConfig,
                    cache_salt: str | None) -> None:
        finished = False
        try:
            async for out in self.loop.generate(prompt_ids, gen_config, request_id, cache_salt=cache_salt):
                finished = out.finished
                self._emit(out)
        except Exception as exc:   # refused (RequestError) or the engine stopped: the request ends with why
            if not finished:
                self._emit(error_output(request_id, f"{type(exc).__name__}: {exc}", len(prompt_ids)))
        finally:
            self.tasks.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """The request's last output (finish_reason "abort") still comes through ``poll``."""
        if request_id in self.tasks:
            self.loop.abort(request_id)

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
        """Why this replica cannot serve (its engine thread stopped, a tensor-parallel rank died), else None."""
        return self.loop.failure or self.engine.failure

    def usage(self) -> dict:
        return dict(self.loop.snapshot)

    def close(self) -> None:
        self.loop.shutdown()
        self.engine.close()


class ReplicaCalls:
    """A Replica's calls as coroutines, forwarded to ``self.replica``: what the in-process handle and the body of
    a replica's Ray actor (lmport.dp.cluster.ReplicaActor) both offer."""
    replica: Replica

    async def submit(self, request_id: str, prompt_ids: list[int], gen_config: GenerationConfig,
                     cache_salt: str | None = None) -> None:
        await self.replica.submit(request_id, prompt_ids, gen_config, cache_salt)

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
