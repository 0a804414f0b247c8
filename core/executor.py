"""Executors run the model runners: in the engine's process at tp=1, one per rank over torch.distributed beyond.

Under tensor parallelism rank 0's runner lives in the engine's process; ranks 1..tp-1
are spawned worker processes (or, on other nodes, started by ``lmport worker``). Each
call is one broadcast of (method, arguments) from rank 0 over a control group, then
every rank runs it; a step's ``StepInput`` therefore crosses the process boundary
once, and the logits come back from rank 0 alone (the LM head gathers them there).

Faults: a worker that raises reports its traceback and exits; its peers' collectives
then fail (gloo notices the closed connection; every collective also has a timeout),
the executor records which rank failed and every later call raises ``WorkerFailed``
at once. ``close`` stops the workers and leaves no process behind.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist

from lmport.backend import Backend
from lmport.config import EngineConfig
from lmport.parallel import TPGroup
from lmport.runner import ModelRunner, StepInput

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
        return self.runner.execute(step)

    def close(self) -> None:
        self.runner.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(config: EngineConfig, backend_cls: type[Backend], rank: int, addr: str) -> tuple[TPGroup, object]:
    """Joins the rendezvous at ``addr`` as ``rank``; returns the compute group and the control group."""
    timeout = datetime.timedelta(seconds=config.dist_timeout)
    try:
        dist.init_process_group(backend_cls.capabilities.dist_backend, init_method=f"tcp://{addr}",
                                rank=rank, world_size=config.tp, timeout=timeout)
    except Exception as exc:
        raise WorkerFailed(f"rank {rank} cannot join the tensor-parallel rendezvous at {addr} "
                           f"(waited up to {config.dist_timeout:g}s): {type(exc).__name__}: {exc}; check that "
                           f"node 0 runs the engine with --dist-init-addr {addr} and that the port is reachable") from exc
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, config.tp, dist.group.WORLD), control


def ranks_per_node(config: EngineConfig) -> int:
    return config.tp // config.nnodes


def _make_backend(backend_cls: type[Backend], local_rank: int, local_world: int) -> Backend:
    return backend_cls(device=backend_cls.setup_rank(local_rank, local_world))


def worker_main(model: str, config: EngineConfig, backend_cls: type[Backend], rank: int, addr: str,
                errors) -> None:
    """A worker process: joins the group, loads its shard, then runs the driver's calls until told to stop."""
    local = rank % ranks_per_node(config)
    runner, control = None, None
    try:
        tp, control = init_rank(config, backend_cls, rank, addr)
        runner = ModelRunner(model, config, _make_backend(backend_cls, local, ranks_per_node(config)), tp)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            if box[0] is None:
                break
            method, args, gather = box[0]
            result = getattr(runner, method)(*args)
            if gather:
                dist.gather_object(result, None, dst=0, group=control)
    except Exception as exc:
        if errors is not None:
            errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            errors.close()
            errors.join_thread()   # os._exit would drop a report still in the queue's feeder thread
        log.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)   # the closed connections end the peers' collectives at once
    dist.destroy_process_group()


class DistributedExecutor:
    """tp > 1: rank 0 here, ranks 1.. of this node in spawned processes, other nodes' ranks from `lmport worker`."""

    def __init__(self, model: str, config: EngineConfig, backend: Backend):
        self.failure: str | None = None
        self.addr = config.dist_init_addr or f"127.0.0.1:{free_port()}"
        backend_cls = type(backend)
        ctx = multiprocessing.get_context("spawn")
        self.errors = ctx.Queue()
        self.procs = {rank: ctx.Process(target=worker_main, args=(model, config, backend_cls, rank, self.addr,
                                                                  self.errors),
                                        name=f"lmport-tp{rank}", daemon=True)
                      for rank in range(1, ranks_per_node(config))}
        for p in self.procs.values():
            p.start()
        atexit.register(self.close)
        try:
            tp, self.control = init_rank(config, backend_cls, 0, self.addr)
            rank0 = _make_backend(backend_cls, 0, ranks_per_node(config))
            self.runner = ModelRunner(model, config, rank0, tp)
            self.run_all("collective_stats")   # every rank has loaded its shard
        except BaseException as exc:
            if not isinstance(exc, WorkerFailed):
                self._fail(exc)
            self.close()
            raise WorkerFailed(self.failure or str(exc)) from exc

    def _call(self, method: str, args: tuple, gather: bool):
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
        return self._call("execute", (step,), gather=False)

    def _fail(self, exc: BaseException) -> None:
        """Records which rank failed (a worker's own report, else its exit) and why."""
        reports = []
        try:
            reports.append(self.errors.get(timeout=2.0))
        except queue.Empty:
            pass
        if reports:
            rank, message, _ = reports[0]
            self.failure = f"tensor-parallel rank {rank} failed: {message}"
        else:
            dead = [f"rank {r} exited with code {p.exitcode}" for r, p in self.procs.items()
                    if p.exitcode is not None]
            self.failure = (f"tensor-parallel {', '.join(dead)}" if dead else
                            f"a tensor-parallel collective failed: {type(exc).__name__}: {exc}")
        log.error("%s", self.failure)

    def close(self) -> None:
        atexit.unregister(self.close)
        if not self.failure and dist.is_initialized():
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
            except Exception:   # a worker already gone: the rest are stopped below
                pass
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        if getattr(self, "runner", None) is not None:
            self.runner.close()
        self.procs = {}


def make_executor(model: str, config: EngineConfig, backend: Backend):
    if config.tp == 1:
        return LocalExecutor(model, config, backend)
    return DistributedExecutor(model, config, backend)
