"""executor="ray": tensor-parallel ranks 1..tp-1 as Ray actors, placed by a placement group.

The same driver as the multiprocess executor (``lmport.executor.local.DistributedExecutor``): rank 0's runner
lives in the engine's process, every call is one broadcast over a gloo control group, and torch.distributed
joins the ranks with the backend's ``dist_backend``. What Ray changes is where the other ranks run and how
their death is seen:

- A placement group holds one bundle a rank, each with the backend's device resource
  (``Capabilities.ray_resource``). Bundle 0 is rank 0's: pinned to the engine's node, or, when the engine
  itself runs in a placement group (a data-parallel replica, ``lmport.dp``), that group is used and its bundle
  0 is the replica's own. Ranks on one node take their device by their index among that node's ranks.
- Each worker rank is one actor whose single long call runs the rank's loop (``run_worker``). The actor dies
  with the rank (a raised error ends the process, as in the multiprocess executor); Ray then resolves that
  call with the actor's death, which names the rank in the engine's failure.
"""
from __future__ import annotations

import logging
import time

from lmport.executor import ray_cluster
from lmport.platform.backend import Backend
from lmport.config import EngineConfig
from lmport.executor.local import DistributedExecutor, run_worker

log = logging.getLogger(__name__)


class _Rank:
    """The body of a rank actor (wrapped by ``ray.remote`` when the executor starts)."""

    def node(self) -> str:
        return ray_cluster.node_id()

    def run(self, model: str, config: EngineConfig, backend_cls: type[Backend], rank: int, addr: str,
            local: tuple[int, int]) -> int:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        return run_worker(model, config, backend_cls, rank, addr, local)


class RayExecutor(DistributedExecutor):
    def __init__(self, model: str, config: EngineConfig, backend: Backend):
        self.ray = ray_cluster.connect(config.ray_address, num_cpus=config.tp)
        self.actors: dict[int, object] = {}
        self.calls: dict[int, object] = {}    # rank -> the ObjectRef of its loop; resolved when the rank ends
        self.pg = None
        self.own_pg = False
        super().__init__(model, config, backend)

    def _host(self) -> str:
        return self.ray.util.get_node_ip_address()

    def _start_workers(self, model: str, backend_cls: type[Backend]) -> int:
        ray, tp = self.ray, self.config.tp
        resource = backend_cls.capabilities.ray_resource
        self.pg = ray_cluster.current_group()
        if self.pg is not None and len(self.pg.bundle_specs) < tp:
            raise ValueError(f"this engine runs in a Ray placement group of {len(self.pg.bundle_specs)} bundles "
                             f"but tp={tp} needs one bundle a rank")
        if self.pg is None:   # rank 0 (this process) on this node; the others where the cluster has room
            here = {f"node:{self._host()}": 0.001}
            bundles = [ray_cluster.rank_bundle(resource) | (here if r == 0 else {}) for r in range(tp)]
            self.pg = ray_cluster.reserve(ray, bundles, f"tp={tp} ranks", self.config.dist_timeout)
            self.own_pg = True
        remote = ray.remote(max_restarts=0)(_Rank)
        self.actors = {r: remote.options(**ray_cluster.actor_options(resource, self.pg, r)).remote()
                       for r in range(1, tp)}
        nodes = {0: ray_cluster.node_id()}
        nodes.update(zip(self.actors, ray.get([a.node.remote() for a in self.actors.values()])))
        local = {r: ([s for s in range(tp) if nodes[s] == nodes[r]].index(r),
                     sum(1 for s in range(tp) if nodes[s] == nodes[r])) for r in range(tp)}
        log.info("tp=%d over Ray: ranks by node %s", tp, nodes)
        self.calls = {r: a.run.remote(model, self.config, backend_cls, r, self.addr, local[r])
                      for r, a in self.actors.items()}
        return local[0][1]

    def _ended(self) -> dict[int, str | None]:
        """rank -> None when its loop returned, else why its actor ended, for each rank that has ended."""
        ray = self.ray
        done, _ = ray.wait(list(self.calls.values()), num_returns=len(self.calls), timeout=0)
        ended = {}
        for rank, ref in self.calls.items():
            if ref in done:
                try:
                    ray.get(ref)
                    ended[rank] = None
                except Exception as exc:   # the actor died (killed, out of memory, its node lost)
                    ended[rank] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return ended

    def _worker_exited(self) -> bool:
        return bool(self.calls) and bool(self._ended())

    def _worker_exits(self) -> list[str]:
        return [f"rank {r} (a Ray actor) died: {why}" for r, why in self._ended().items() if why is not None]

    def _stop_workers(self, grace: float) -> None:
        if self.calls:
            self.ray.wait(list(self.calls.values()), num_returns=len(self.calls), timeout=grace)
        for actor in self.actors.values():
            self.ray.kill(actor)
        if self.own_pg and self.pg is not None:
            ray_cluster.release(self.pg)
        self.actors, self.calls, self.pg = {}, {}, None

    def kill_rank(self, rank: int) -> None:
        """Kills rank ``rank``'s actor (for fault tests and drills); the next call fails naming it."""
        self.ray.kill(self.actors[rank])
        deadline = time.monotonic() + 10
        while rank not in self._ended() and time.monotonic() < deadline:
            time.sleep(0.05)
