"""The engine core's memory when it is idle: what the backend keeps for its steps goes back to the system.

The cpu backend keeps freed step memory in glibc's heap (lmport.backends.cpu.malloc) so that the next step does
not fault fresh pages in. Steps of varied shapes leave that memory in holes the heap grows around: over a soak
the core's RSS grew by tens of MB while its live memory (Python objects, bytes malloc'd and in use) stayed
flat. The core's loop hands it back (Backend.release_idle_memory) after a whole idle wait that followed steps,
never between steps. The loop (lmport.engine.core_process.serve) is driven with a scripted message queue: a
wait with nothing is an idle wait, without a clock.
"""
from __future__ import annotations

import os
import platform
import random

import pytest
import torch

from lmport.backends.cpu import CpuBackend
from lmport.config import EngineConfig, GenerationConfig
from lmport.engine import core_process
from lmport.engine.core import EngineCore
from lmport.engine.messages import Add, EngineRequest, Shutdown, pack, to_front_end
from support.model_helpers import tiny_model_dir

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.fixture(scope="module")
def engine():
    engine = EngineCore(tiny_model_dir("llama"), EngineConfig(device_type="cpu", cache_max_entry_count=256,
                                                              max_batch_size=8))
    yield engine
    engine.close()


def requests(count: int, seed: int = 0) -> list[bytes]:
    """Adds of varied shapes: prompt lengths, top logprobs."""
    rng = random.Random(seed)
    adds = []
    for i in range(count):
        prompt = [rng.randrange(3, 40000) for _ in range(rng.choice([5, 30, 60]))]
        config = GenerationConfig(max_new_tokens=rng.randint(1, 6), ignore_eos=True, logprobs=rng.choice([None, 5]))
        adds.append(pack(Add(EngineRequest(f"r{i}", prompt, config))))
    return adds


class Script:
    """The core's message queue: the adds, then idle waits (``receive(IDLE_WAIT)`` answered with nothing), then
    a shutdown; ``at_idle(n)`` runs at the n-th idle wait."""

    def __init__(self, adds: list[bytes], idle_waits: int, at_idle=lambda n: None):
        self.adds, self.idle_waits, self.at_idle = list(adds), idle_waits, at_idle
        self.finished, self.idle, self.busy_waits = 0, 0, 0

    def receive(self, timeout: float | None) -> bytes | None:
        if self.adds:
            return self.adds.pop(0)
        if timeout != core_process.IDLE_WAIT:
            self.busy_waits += 1
            return None
        self.at_idle(self.idle)
        self.idle += 1
        return None if self.idle <= self.idle_waits else pack(Shutdown())

    def send(self, data: bytes) -> None:
        message = to_front_end(data)
        self.finished += sum(1 for o in getattr(message, "outputs", []) if o.finished)


def test_the_core_gives_back_kept_memory_once_per_idle_wait_after_steps_and_never_between_steps(engine, monkeypatch):
    released: list[tuple[int, int]] = []   # (outputs finished, busy waits) at each release
    script = Script(requests(6), idle_waits=3)
    monkeypatch.setattr(type(engine.backend), "release_idle_memory",
                        lambda self: released.append((script.finished, script.busy_waits)))
    core_process.serve(engine, script.receive, script.send)
    assert script.finished == 6 and script.busy_waits > 0
    # Once, after every request had finished: the later idle waits followed no step.
    assert released == [(6, script.busy_waits)]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not GLIBC, reason="the cpu backend keeps freed memory in glibc's heap only")
def test_the_cpu_backend_gives_the_step_memory_it_kept_back_to_the_system():
    backend = CpuBackend()   # glibc keeps freed blocks up to 32 MB (malloc.keep_freed_memory)
    # A step's activations, freed below a block still in use: a hole glibc keeps for the next step.
    activations = [torch.ones(8 << 20, dtype=torch.uint8) for _ in range(16)]
    in_use = torch.ones(1 << 20, dtype=torch.uint8)
    held = rss()
    del activations
    kept = rss()
    backend.release_idle_memory()
    given_back = kept - rss()
    assert in_use.sum() == 1 << 20
    # Kept through the free (what saves the next step its page faults), given back when idle.
    assert held - kept < 32 << 20 and given_back > 96 << 20, (held, kept, given_back)
