"""Data-parallel replicas as Ray actors: placing them, their handles, and the front end over them.

Each replica gets a placement group of tp bundles (one a rank, each with the backend's device resource,
``lmport.executor.ray_cluster.rank_bundle``). The replica's actor, which runs its engine and tensor-parallel rank 0,
sits in bundle 0; at tp > 1 its engine's Ray executor puts ranks 1..tp-1 in bundles 1.. of the same group.
The actor is created with unlimited restarts: when its process dies Ray starts it again in the same group,
which builds its engine anew (the model loads again, the cache starts empty); ``RayHandle.restart`` also
restarts one whose engine failed while its process lives.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from lmport.executor import ray_cluster
from lmport.config import EngineConfig
from lmport.dp.frontend import DataParallel
from lmport.dp.replica import InProcessHandle, Replica, ReplicaCalls
from lmport.dp.router import PrefixRouter
from lmport.engine.messages import EngineInfo, unpack
from lmport.platform.resolution import resolve_config

log = logging.getLogger(__name__)


class ReplicaActor(ReplicaCalls):
    """The body of a replica's Ray actor: a Replica whose every method is async (Ray runs them on the
    actor's one event loop, where the Replica's tasks live)."""

    def __init__(self, model: str, config: EngineConfig, index: int):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        self.replica = Replica(model, config, index)

    async def info(self) -> dict:
        return self.replica.info()

    async def health(self) -> str | None:
        return self.replica.health()

    async def usage(self) -> dict:
        return self.replica.usage()


class RayHandle:
    """The front end's handle on one replica actor."""

    def __init__(self, ray, actor, pg):
        self.ray, self.actor, self.pg = ray, actor, pg

    async def submit(self, request: bytes) -> None:
        await self.actor.submit.remote(request)

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)

    async def poll(self, timeout: float):
        return await self.actor.poll.remote(timeout)

    async def restart(self) -> dict:
        """The replica's usage once it serves again; raises while it is not back yet. A replica whose process
        died is restarted by Ray; one whose engine failed in a live process is killed here, for Ray to
        restart."""
        problem = await self.actor.health.remote()
        if problem is not None:
            self.ray.kill(self.actor, no_restart=False)
            raise RuntimeError(f"its engine failed ({problem}); Ray is restarting its actor")
        return await self.actor.usage.remote()

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.actor.close.remote(), 30)
        finally:
            self.ray.kill(self.actor)
            ray_cluster.release(self.pg)


def start(model: str, config: EngineConfig, dp: int, *, policy: str = "prefix", balance_threshold: int = 16,
          max_blocks: int = 32) -> DataParallel:
    """``dp`` replicas of ``model`` on the Ray cluster (``config.ray_address``, else a local one), ready, behind
    the front end that routes to them."""
    resolved = resolve_config(config)
    resource = resolved.backend_class().capabilities.ray_resource
    ray = ray_cluster.connect(config.ray_address, num_cpus=dp * config.tp)
    # Ranks beyond 0 of a replica are Ray actors in the replica's placement group, whatever config.executor says.
    config = dataclasses.replace(config, executor="ray")
    remote = ray.remote(max_restarts=-1)(ReplicaActor)
    handles = []
    try:
        for i in range(dp):
            pg = ray_cluster.reserve(ray, [ray_cluster.rank_bundle(resource)] * config.tp,
                                     f"data-parallel replica {i} (tp={config.tp})", config.dist_timeout)
            actor = remote.options(name=None, **ray_cluster.actor_options(resource, pg, 0)).remote(model, config, i)
            handles.append(RayHandle(ray, actor, pg))
        infos = ray.get([h.actor.info.remote() for h in handles])
    except BaseException:
        for h in handles:
            ray.kill(h.actor)
            ray_cluster.release(h.pg)
        raise
    usages = ray.get([h.actor.usage.remote() for h in handles])
    front = _front(handles, infos[0], usages, policy, balance_threshold, max_blocks)
    log.info("data parallelism: %d replicas of %s (tp=%d), %d KV blocks each", dp, model, config.tp,
             front.info.num_blocks)
    return front


def in_process(model: str, config: EngineConfig, dp: int, *, policy: str = "prefix", balance_threshold: int = 16,
               max_blocks: int = 32) -> DataParallel:
    """``dp`` replicas in this process, without Ray (tests; each restart builds its engine anew). At tp > 1 each
    replica's ranks need their own process group, which one process cannot hold: tp=1 only."""
    if config.tp > 1:
        raise ValueError("in-process replicas run at tp=1 only (one torch.distributed group a process)")
    handles = [InProcessHandle(lambda i=i: Replica(model, config, i)) for i in range(dp)]
    return _front(handles, handles[0].replica.info(), [h.replica.usage() for h in handles], policy,
                  balance_threshold, max_blocks)


def _front(handles: list, info: dict, usages: list[dict], policy: str, balance_threshold: int,
           max_blocks: int) -> DataParallel:
    """The routing front end over ``handles``, from one replica's ``info`` (Replica.info)."""
    router = PrefixRouter(len(handles), info["block_size"], seed=info["prefix_seed"], policy=policy,
                          balance_threshold=balance_threshold, max_blocks=max_blocks)
    return DataParallel(handles, router, unpack(info["engine"], EngineInfo), usages)
