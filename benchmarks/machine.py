"""The machine a benchmark ran on: CPU model and flags, measured memory bandwidth, load average."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in (platform.processor(), platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def memory_bandwidth_gbs(mib: int = 256, rounds: int = 5) -> float:
    """GB/s of the best of ``rounds`` copies of a ``mib`` MiB buffer (read + write counted)."""
    import torch
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return round(2 * src.numel() * 4 / best / 1e9, 1)


def describe() -> dict:
    return {**cpu(), "memory_bandwidth_gbs": memory_bandwidth_gbs(), "load_average": list(os.getloadavg()),
            "python": platform.python_version(), "host": platform.node()}


def line(info: dict) -> str:
    return (f"{info['cpu']} ({info['cpus']} CPUs; {' '.join(info['flags']) or 'no AVX2'}), memory copy "
            f"{info['memory_bandwidth_gbs']} GB/s, load average {' '.join(f'{x:.1f}' for x in info['load_average'])}")
