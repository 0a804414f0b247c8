"""What a benchmark reports about the machine it ran on: the CPU's model and the instruction sets that matter
to the kernels, the load, the accelerator if there is one, and the memory read bandwidth measured in the same
run (a decode step reads every weight once, so bytes / bandwidth is the fastest a token can be)."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# The flags the kernels (lmport's and llama.cpp's) pick their paths by.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "amx_tile", "amx_int8", "amx_bf16")


def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "cores": len(os.sched_getaffinity(0)),
            "kernel_flags": [f for f in KERNEL_FLAGS if f in flags], "load_average": os.getloadavg()}


def gpu_info() -> list[dict]:
    """The CUDA devices torch sees (name, memory, capability); empty without one."""
    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append({"name": props.name, "memory_bytes": props.total_memory,
                        "capability": f"{props.major}.{props.minor}"})
    return devices


def memory_bandwidth(threads: int, gib: float = 1.0, rounds: int = 7, now=time.perf_counter) -> dict:
    """Read bandwidth in GB/s with ``threads`` threads: torch's float32 sum over a buffer far larger
    than the caches (a streaming read, vectorized and split over the threads), best and median of
    ``rounds``; ``now`` the clock (time.thread_time counts one thread's own time)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * 2**30) // 4)
        x.sum()
        rates = []
        for _ in range(rounds):
            start = now()
            x.sum()
            rates.append(x.numel() * 4 / (now() - start) / 1e9)
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "best_gbs": max(rates), "median_gbs": statistics.median(rates),
            "method": f"torch.sum over {gib:g} GiB of float32, {rounds} rounds"}


def describe(threads: int = 2, bandwidth_gib: float = 1.0) -> dict:
    """cpu_info() with the read bandwidth at ``threads`` threads and the GPUs, for a benchmark's JSON."""
    return {**cpu_info(), "memory_bandwidth": memory_bandwidth(threads, bandwidth_gib), "gpus": gpu_info(),
            "torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}


def line(info: dict) -> str:
    """describe() in one line for a benchmark's printed table."""
    gpus = "".join(f", {g['name']}" for g in info.get("gpus", []))
    return (f"{info['model']} ({info['cores']} cores; {' '.join(info['kernel_flags']) or 'no AVX2'}){gpus}, memory "
            f"read {info['memory_bandwidth']['best_gbs']:.1f} GB/s, load average "
            f"{' '.join(f'{x:.1f}' for x in info['load_average'])}")


def median_min_max(values: list[float]) -> dict:
    """A benchmark's rounds as the JSON keeps them."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread(values: list[float], fmt: str = ".3g") -> str:
    """A benchmark's rounds as "median (min-max)", each in ``fmt``; "-" for none."""
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def config_fields(config) -> dict:
    """A dataclass config's fields for a result's JSON (values JSON does not know as their text)."""
    import dataclasses
    return {f.name: json.loads(json.dumps(getattr(config, f.name), default=str)) for f in dataclasses.fields(config)}


def write_result(out: Path | str, result) -> None:
    """A benchmark's result as JSON at ``out`` (its directory made), and where it went on stderr."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def write_to_directory(directory: Path | str, name: str, result) -> Path:
    """``result`` as ``directory/NAME-<UTC time>.json``: runs written to one directory are all kept."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(directory) / f"{name}-{stamp}.json"
    n = 1
    while path.exists():   # two runs in one second
        n += 1
        path = Path(directory) / f"{name}-{stamp}-{n}.json"
    write_result(path, result)
    return path
