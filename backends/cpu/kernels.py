"""The cpu backend's C++ kernels, compiled with torch's extension builder on first use.

The build (about 45 s, once per kind of CPU and source version) is cached by
torch under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``).
If it cannot run (no compiler, no ninja) or ``LMPORT_CPU_KERNELS=0`` is set,
``load()`` returns None and the backend keeps the reference ops.

The kernels have an AVX-512 path (BW, VL and VNNI) and an AVX2 one; the build targets the CPU it
runs on. ``LMPORT_CPU_ISA=avx2`` builds the AVX2 path on an AVX-512 machine (``-mno-avx512f``, which
turns off every AVX-512 subset), to measure and test what a CPU without AVX-512 runs.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / "kernels.cpp"]  # includes the csrc/*.h kernels


# What the kernels take besides float32 tensors (the backend's methods and its decoder runner ask).
def small_linear_takes(in_features: int) -> bool:
    return in_features % 8 == 0


# The GGUF block types csrc/ggml_linear.h runs (the compiled module's ggml_types() lists the same).
GGML_TYPES = frozenset({"q4_k", "q6_k", "q5_0", "q5_k", "q5_1", "q3_k", "q2_k", "iq4_nl", "iq4_xs"})


def attention_takes(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= 256


def machine_tag() -> str:
    """A short hash of this CPU's model and instruction sets. The build targets the CPU it runs
    on (-march=native); naming it after the CPU keeps a cache shared between unlike machines
    (a home directory on a cluster) from loading code the CPU cannot run."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        described = [line for line in info if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        described = []
    return hashlib.sha1("\n".join([platform.machine(), *described]).encode()).hexdigest()[:10]


def isa_flags() -> list[str]:
    """The compiler flags that pick the instruction sets: this CPU's, less AVX-512 under LMPORT_CPU_ISA=avx2."""
    isa = os.environ.get("LMPORT_CPU_ISA", "native")
    if isa not in ("native", "avx2"):
        raise ValueError(f"LMPORT_CPU_ISA={isa!r}: use 'native' (this CPU's instruction sets) or 'avx2'")
    return ["-march=native"] + (["-mno-avx512f"] if isa == "avx2" else [])


def build_name() -> str:
    """The build's name: this CPU, these sources, and _avx2 for the AVX2 build (LMPORT_CPU_ISA)."""
    avx2 = len(isa_flags()) > 1
    return f"lmport_cpu_kernels_{machine_tag()}_{source_tag()}" + ("_avx2" if avx2 else "")


def source_tag() -> str:
    """A short hash of the kernel sources (every csrc file): the build directory is named after it, so
    checkouts with different sources sharing one extensions cache never load each other's build."""
    digest = hashlib.sha1()
    for path in sorted((Path(__file__).parent / "csrc").iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:8]


@functools.cache
def load():
    """The compiled module, or None (the reason is logged once)."""
    if os.environ.get("LMPORT_CPU_KERNELS", "1") == "0":
        log.info("cpu kernels off (LMPORT_CPU_KERNELS=0): using the reference ops")
        return None
    isa = isa_flags()   # a bad LMPORT_CPU_ISA is the user's to fix, not a build failure to fall back from
    try:
        from torch.utils.cpp_extension import load as build
        log.info("loading the cpu kernels (built on first use, once per kind of CPU)")
        return build(build_name(), [str(s) for s in SOURCES], extra_cflags=["-O3", *isa, "-fopenmp"],
                     extra_ldflags=["-fopenmp"])
    except Exception as exc:  # any build failure leaves the reference ops in place
        log.warning("cpu kernels unavailable, using the reference ops: %s: %s", type(exc).__name__,
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None
