"""Executors run the model runners: in the engine's process at tp=1, one per rank over torch.distributed beyond.

Under tensor parallelism rank 0's runner lives in the engine's process; ranks 1..tp-1
are spawned worker processes (or, on other nodes, started by ``lmport worker``). Each
call is one broadcast of (method, arguments) from rank 0 over a control group, then
every rank runs it; a step's ``StepInput`` therefore crosses the process boundary
once, and the logits come back from rank 0 alone (the LM head gathers them there).

Faults: a worker that raises reports its error through the rendezvous store and exits;
its peers' collectives then fail (gloo notices the closed connection; every collective
also has a timeout, ``dist_timeout``),
the executor records which rank failed and every later call raises ``WorkerFailed``
at once. ``close`` stops the workers and leaves no process behind.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import subprocess
import sys
import time
import traceback
from typing import cast

import torch
import torch.distributed as dist

from lmport.platform.backend import Backend
from lmport.config import ConfigError, EngineConfig
from lmport.parallel import TPGroup
from lmport.worker.runner import ModelRunner, StepInput

log = logging.getLogger(__name__)

# The control group waits for the driver's next command for as long as the engine idles.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died or raised; the engine cannot run the model any more."""


class LocalExecutor:
    """tp=1: the runner in this process, called directly (no process, no serialization)."""

    def __init__(self, model: str, config: EngineConfig, backend: Backend):
        self.runner = ModelRunner(model, config, backend)
        self.failure: str | None = None

    def run_all(self, method: str, *args) -> list:
        return [getattr(self.runner, method)(*args)]

    def execute(self, step: StepInput) -> torch.Tensor:
        return cast(torch.Tensor, self.runner.execute(step))   # rank 0's runner always returns the logits

    def close(self) -> None:
        self.runner.close()


def ranks_per_node(config: EngineConfig) -> int:
    return config.tp // config.nnodes


def _joined_key(rank: int) -> str:
    return f"lmport/joined/{rank}"


def _error_key(rank: int) -> str:
    return f"lmport/error/{rank}"


def _connect(config: EngineConfig, addr: str, rank: int):
    """The rendezvous store at ``addr`` (rank 0 hosts it: at port 0 on a port the OS picks, ``store.port``);
    a clear error when it cannot be reached."""
    host, _, port = addr.rpartition(":")
    if rank != 0 and int(port) == 0:
        raise WorkerFailed(f"rank {rank}: the rendezvous address {addr} has port 0; give the address node 0 "
                           f"logged (`the tensor-parallel rendezvous listens at HOST:PORT`)")
    timeout = datetime.timedelta(seconds=config.dist_timeout)
    try:
        store = dist.TCPStore  # pyright: ignore[reportPrivateImportUsage]
        return store(host, int(port), config.tp, is_master=rank == 0, timeout=timeout,
                     wait_for_workers=False)
    except Exception as exc:
        raise WorkerFailed(f"rank {rank} cannot reach the tensor-parallel rendezvous at {addr} within "
                           f"{config.dist_timeout:g}s ({type(exc).__name__}: {exc}); check that node 0 runs the "
                           f"engine with --dist-init-addr {addr} and that the port is reachable from here") from exc


def _join(config: EngineConfig, backend_cls: type[Backend], store, rank: int) -> tuple[TPGroup, object]:
    """Joins the process group; returns the compute group (timeouts: dist_timeout) and the control group."""
    dist.init_process_group(backend_cls.capabilities.dist_backend, store=store, rank=rank, world_size=config.tp,
                            timeout=datetime.timedelta(seconds=config.dist_timeout))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, config.tp, dist.group.WORLD), control


def _make_backend(backend_cls: type[Backend], local_rank: int, local_world: int) -> Backend:
    return backend_cls(device=backend_cls.setup_rank(local_rank, local_world))


def run_worker(model: str, config: EngineConfig, backend_cls: type[Backend], rank: int, addr: str,
               local: tuple[int, int] | None = None) -> int:
    """One worker rank: joins the group, loads its shard, then runs the driver's calls until told to stop.
    ``local``: (this rank's index among its host's ranks, their number); default: from ``nnodes``.
    A failure is reported to rank 0 through the rendezvous store, then the process exits (code 1)."""
    store = _connect(config, addr, rank)
    try:
        store.set(_joined_key(rank), "1")
        tp, control = _join(config, backend_cls, store, rank)
        local_rank, local_world = local or (rank % ranks_per_node(config), ranks_per_node(config))
        runner = ModelRunner(model, config, _make_backend(backend_cls, local_rank, local_world), tp)
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            if box[0] is None:
                break
            method, args, gather = box[0]
            result = getattr(runner, method)(*args)
            if gather:
                dist.gather_object(result, None, dst=0, group=control)
    except BaseException as exc:
        log.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            store.set(_error_key(rank), f"{type(exc).__name__}: {exc}")
        except Exception:   # rank 0 (and its store) is gone: nobody to tell
            pass
        os._exit(1)   # the closed connections end the peers' collectives at once
    dist.destroy_process_group()
    return 0


def _stdin_worker() -> None:
    """Entry of a worker process started by this node's engine (or `lmport worker`): arguments on stdin."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run_worker(*pickle.load(sys.stdin.buffer)))


def start_workers(model: str, config: EngineConfig, backend_cls: type[Backend], addr: str,
                  ranks: range) -> dict[int, subprocess.Popen]:
    """Worker processes for ``ranks``: fresh interpreters (nothing of the caller's state is inherited), in the
    caller's process group, so a Ctrl-C reaches them too."""
    procs = {}
    for rank in ranks:
        p = subprocess.Popen([sys.executable, "-c", "from lmport.executor.local import _stdin_worker; _stdin_worker()"],
                             stdin=subprocess.PIPE)
        p.stdin.write(pickle.dumps((model, config, backend_cls, rank, addr)))
        p.stdin.close()
        procs[rank] = p
    return procs


def stop_workers(procs: dict[int, subprocess.Popen], grace: float = 10.0) -> None:
    deadline = time.monotonic() + grace
    for p in procs.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class DistributedExecutor:
    """tp > 1: rank 0 here, ranks 1.. of this node in worker processes, other nodes' ranks from `lmport worker`."""

    def __init__(self, model: str, config: EngineConfig, backend: Backend):
        if dist.is_initialized():   # torch.distributed has one default process group a process
            raise ConfigError(f"tp={config.tp}: this process already runs a tensor-parallel engine (or another "
                              f"torch.distributed group); close it first, or run the engines in separate processes")
        self.failure: str | None = None
        self.config = config
        # Rank 0 binds the store's port itself (port 0 by default: the OS picks one, which nobody can take
        # between choosing and binding); the workers are then told the port it got.
        host, _, port = (config.dist_init_addr or f"{self._host()}:0").rpartition(":")
        self.store = _connect(config, f"{host}:{port}", 0)
        self.addr = f"{host}:{self.store.port}"
        if config.nnodes > 1 and int(port) == 0:
            log.warning("the tensor-parallel rendezvous listens at %s: start `lmport worker --dist-init-addr %s` "
                        "on nodes 1..%d", self.addr, self.addr, config.nnodes - 1)
        backend_cls = type(backend)
        self.procs: dict[int, subprocess.Popen] = {}
        self.runner = None
        atexit.register(self.close)
        try:
            local_world = self._start_workers(model, backend_cls)
            self._wait_for_ranks()
            tp, self.control = _join(config, backend_cls, self.store, 0)
            rank0 = _make_backend(backend_cls, 0, local_world)
            self.runner = ModelRunner(model, config, rank0, tp)
            self.run_all("barrier")   # every rank has loaded its shard
        except BaseException as exc:
            if self.failure is None:
                self._fail(exc)
            self.close()
            if isinstance(exc, (KeyboardInterrupt, ConfigError)):
                raise
            raise WorkerFailed(self.failure) from exc

    # -- how workers start, end and are seen to fail (RayExecutor overrides these) --------------------
    def _host(self) -> str:
        """The address the other ranks reach rank 0's rendezvous at."""
        return "127.0.0.1"

    def _start_workers(self, model: str, backend_cls: type[Backend]) -> int:
        """Starts this node's worker ranks; returns how many ranks (rank 0 included) share rank 0's host."""
        self.procs = start_workers(model, self.config, backend_cls, self.addr, range(1, ranks_per_node(self.config)))
        return ranks_per_node(self.config)

    def _worker_exited(self) -> bool:
        return any(p.poll() is not None for p in self.procs.values())

    def _worker_exits(self) -> list[str]:
        """How each worker that ended abnormally ended ("rank 2 exited with code -9 (signal 9)")."""
        return [f"rank {r} exited with code {p.returncode}" + (f" (signal {-p.returncode})" if p.returncode < 0
                                                               else "")
                for r, p in self.procs.items() if p.poll() is not None and p.returncode != 0]

    def _stop_workers(self, grace: float) -> None:
        stop_workers(self.procs, grace)

    @property
    def worker_pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def _wait_for_ranks(self) -> None:
        """Until every rank has reached the rendezvous; a local worker that exits first fails at once."""
        keys = [_joined_key(r) for r in range(1, self.config.tp)]
        deadline = time.monotonic() + self.config.dist_timeout
        while not self.store.check(keys):
            if self._worker_exited() or time.monotonic() > deadline:
                missing = [r for r in range(1, self.config.tp) if not self.store.check([_joined_key(r)])]
                self.failure = self._dead_ranks() or (
                    f"tensor-parallel ranks {missing} did not reach the rendezvous at {self.addr} within "
                    f"{self.config.dist_timeout:g}s (start `lmport worker` on the other nodes)")
                raise WorkerFailed(self.failure)
            time.sleep(0.05)

    def _call(self, method: str, args: tuple, *, gather: bool):
        if self.failure:
            raise WorkerFailed(self.failure)
        try:
            dist.broadcast_object_list([(method, args, gather)], src=0, group=self.control)
        except Exception as exc:
            self._fail(exc)
            raise WorkerFailed(self.failure) from exc
        try:
            result = getattr(self.runner, method)(*args)
        except Exception as exc:
            if self._collective_error(exc):
                self._fail(exc)
                raise WorkerFailed(self.failure) from exc
            self.failure = f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}"
            raise   # the caller sees rank 0's own error (CacheDoesNotFit, say)
        try:
            if gather:
                results = [None] * self.runner.tp.size
                dist.gather_object(result, results, dst=0, group=self.control)
                return results
            return result
        except Exception as exc:
            self._fail(exc)
            raise WorkerFailed(self.failure) from exc

    @staticmethod
    def _collective_error(exc: Exception) -> bool:
        """Whether ``exc`` came from a collective (a peer gone or timed out), not from rank 0's own work."""
        return isinstance(exc, (dist.DistBackendError, dist.DistError)) or "gloo" in str(exc).lower()

    def run_all(self, method: str, *args) -> list:
        """``method(*args)`` on every rank's runner; the results in rank order."""
        return self._call(method, args, gather=True)

    def execute(self, step: StepInput) -> torch.Tensor:
        return cast(torch.Tensor, self._call("execute", (step,), gather=False))   # rank 0's logits

    def _dead_ranks(self) -> str | None:
        """What the failed ranks reported through the store, else which local workers exited and how."""
        reports = [f"rank {r} failed: {self.store.get(_error_key(r)).decode()}" for r in range(1, self.config.tp)
                   if self.store.check([_error_key(r)])]
        exits = self._worker_exits()
        return "tensor-parallel " + "; ".join(reports or exits) if reports or exits else None

    def _fail(self, exc: BaseException) -> None:
        """Records which rank failed (its own report, else its exit) and why; gives a dying worker 2 s to say."""
        deadline = time.monotonic() + 2.0
        while (found := self._dead_ranks()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.failure = found or f"a tensor-parallel collective failed: {type(exc).__name__}: {exc}"
        log.error("%s", self.failure)

    def close(self) -> None:
        """Stops every worker (they leave their loop, else they are killed) and leaves the process group."""
        atexit.unregister(self.close)
        if not self.failure and self.runner is not None:
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
            except Exception:   # a worker already gone: the rest are stopped below
                pass
        if dist.is_initialized():
            dist.destroy_process_group()   # workers still waiting on a collective see the closed connections
        self._stop_workers(grace=10.0 if not self.failure else 5.0)
        if self.runner is not None:
            self.runner.close()


def make_executor(model: str, config: EngineConfig, backend: Backend):
    """tp=1: in this process (whatever ``config.executor`` says: there is no other rank to place); beyond,
    worker ranks as processes of this node and ``lmport worker`` ("mp"). The Ray executor ("ray") lives in
    ``lmport.executor.ray_executor``, which builds on this module; ``lmport.engine.core`` picks it."""
    if config.tp == 1:
        return LocalExecutor(model, config, backend)
    return DistributedExecutor(model, config, backend)
