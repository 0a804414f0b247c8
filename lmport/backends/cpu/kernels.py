"""The cpu backend's C++ kernels, compiled with torch's extension builder on first use.

The build (an object per translation unit, compiled in parallel by ninja; once per kind of CPU and source
version) is cached by torch under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), built
from a copy of the sources kept in the build directory: every checkout or install of the same sources shares it.
If it cannot run (no compiler, no ninja) or ``LMPORT_CPU_KERNELS=0`` is set,
``load()`` returns None and the backend keeps the reference ops.

The kernels have an AVX-512 path (BW, VL and VNNI) and an AVX2 one; the build targets the CPU it
runs on. ``LMPORT_CPU_ISA=avx2`` builds the AVX2 path on an AVX-512 machine (``-mno-avx512f``, which
turns off every AVX-512 subset), to measure and test what a CPU without AVX-512 runs.
``LMPORT_CPU_PREFILL`` says how precisely a prefill's linears compute (``prefill_precision``): by default a
prefill over quantized weights held interleaved takes AMX tiles in bfloat16 where the CPU has them.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from lmport.kv.layout import LayerCache

log = logging.getLogger(__name__)

# The kernel sources; the build is named after their hash (source_tag). One translation unit per kernel family and
# bindings.cpp with the torch glue, compiled into one module; the headers beside them and under isa/ (the code
# per instruction set) are what they include. docs/architecture.md shows the layout.
CSRC = Path(__file__).parent / "csrc"
SOURCES = ["bindings.cpp", "decoder_layers.cpp", "elementwise.cpp", "gated_delta_net.cpp", "ggml_experts.cpp",
           "ggml_linear.cpp", "interleave.cpp", "kv_fill.cpp", "linear.cpp", "paged_attention.cpp",
           "quant_linear.cpp"]


def source_files() -> list[Path]:
    """Every file of the kernel sources (csrc and its folders), in a fixed order."""
    return sorted(path for path in CSRC.rglob("*") if path.is_file())


# What the kernels take besides float32 tensors (the backend's methods and its decoder runner ask).
def small_linear_takes(in_features: int) -> bool:
    return in_features % 8 == 0


# The GGUF block types csrc/ggml_blocks.h decodes (the compiled module's ggml_types() lists the same).
GGML_TYPES = frozenset({"q4_k", "q6_k", "q5_0", "q5_k", "q5_1", "q3_k", "q2_k", "iq4_nl", "iq4_xs", "mxfp4"})


def kernel_mins(weight) -> torch.Tensor | None:
    """A quantized weight's mins as quant_linear takes them: None where all are zero (GGUF's Q8_0), so the
    kernel neither reads them nor adds their products."""
    return None if weight.zero_mins else weight.mins


def attention_takes(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= 256


def cache_takes(cache: LayerCache) -> bool:
    """Whether the kernels read and write ``cache``: float32 or float16 values, or 8-/4-bit codes with float32
    params (a float32 model's; a 16-bit model's float16 params, and an fp8 cache, go to the reference ops)."""
    if cache.quant_policy == 0:
        return cache.k.dtype in (torch.float32, torch.float16)
    return cache.k_qparams is not None and cache.k_qparams.dtype == torch.float32


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
    for path in source_files():
        digest.update(path.relative_to(CSRC).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:8]


def build_directory() -> Path:
    """Where this build lives: torch's extensions directory (``$TORCH_EXTENSIONS_DIR``, else its default root
    with a folder per Python version: the module is built for one), in a folder of lmport's own."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root
        root = str(Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    return Path(root) / "lmport" / build_name()


def staged_sources(directory: Path) -> list[str]:
    """The sources to build, copied once into ``directory/csrc`` (the directory is named after their hash, so
    a copy there never goes stale). torch's build file names each source by its absolute path: two checkouts
    of the same sources, each built where it lies, rewrote each other's build file and ninja rebuilt for
    every process that alternated between them."""
    staged = directory / "csrc"
    for path in source_files():
        target = staged / path.relative_to(CSRC)
        if not target.exists():   # never rewritten: a newer mtime would make ninja rebuild
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.parent / f".{path.name}.{os.getpid()}"
            shutil.copyfile(path, partial)
            os.replace(partial, target)   # whole or absent for a process building beside this one
    return [str(staged / name) for name in SOURCES]


# Written after a build succeeds: the module's size and mtime. torch's loader takes a lock file in the build
# directory and runs ninja on every load, even with nothing to rebuild; a process killed while holding it left
# the lock behind and every later load waited on it forever. A build marked complete is imported directly.
BUILT = "built"


def _mark_built(directory: Path, library: Path) -> None:
    stat = library.stat()
    partial = directory / f".{BUILT}.{os.getpid()}"
    partial.write_text(f"{library.name} {stat.st_size} {stat.st_mtime_ns}\n")
    os.replace(partial, directory / BUILT)


def _load_built(directory: Path):
    """The module of a build marked complete whose library is still the one marked, else None."""
    try:
        name, size, mtime = (directory / BUILT).read_text().split()
        stat = (directory / name).stat()
    except (OSError, ValueError):
        return None
    if (stat.st_size, stat.st_mtime_ns) != (int(size), int(mtime)):
        return None   # rebuilt since (by a loader of an older version): torch's loader decides
    import importlib.util   # the library links against torch's, loaded by this module's import of torch
    spec = importlib.util.spec_from_file_location(build_name(), directory / name)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None   # a damaged library: torch's loader rebuilds it
    return module


PREFILL_PRECISIONS = ("auto", "exact", "bf16")


def prefill_precision() -> str:
    """LMPORT_CPU_PREFILL, how a prefill's linears compute (a step of more than 128 rows of x):

    - 'auto' (the default): over quantized weights held with their rows interleaved (``hold_quantized``: GGUF's
      Q4_K, Q5_K, Q6_K and Q5_0, int4 and int8 weights) on AMX tiles in bfloat16 where the CPU and build have
      them, else as 'exact'; GEMMs over float32 weights in float32. The quantized model's activations are rounded to
      bfloat16 (8 significant bits), finer than the 8-bit codes llama.cpp gives them, at several times the rate.
    - 'exact': x held to 16 bits and the weights exactly, as a decode step's are, or a float32 GEMM.
    - 'bf16': as 'auto', and the GEMMs over float32 weights (a float model's, or a quantized one expanded for a
      prefill) in oneDNN's bfloat16 math where the CPU has bfloat16 products (``bf16_products``).

    A step of at most 128 rows of x (a decode step's) always runs the exact kernels."""
    value = os.environ.get("LMPORT_CPU_PREFILL", "auto")
    if value not in PREFILL_PRECISIONS:
        raise ValueError(f"LMPORT_CPU_PREFILL={value!r}: use 'auto' (the default: quantized weights on AMX tiles "
                         f"in bfloat16 where the CPU has them), 'exact' or 'bf16' (every prefill GEMM in bfloat16)")
    return value


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))


def bf16_products() -> bool:
    """Whether oneDNN (torch's) computes bfloat16 products in hardware here: AMX tiles or AVX512_BF16 (Linux's
    CPU flags), with torch built with oneDNN, and not under LMPORT_CPU_ISA=avx2, which stands for a CPU without
    AVX-512. Without them oneDNN emulates bfloat16, slower than its float32 GEMM."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.backends.mkldnn.matmul, "fp32_precision")
            and len(isa_flags()) == 1 and not _cpu_flags().isdisjoint({"amx_bf16", "avx512_bf16"}))


# Whether a prefill's GEMM over a float32 weight (CpuBackend's prefill_gemm) computes in bfloat16 (set_bf16_gemm).
_bf16_gemm = False


def set_bf16_gemm(on: bool) -> bool:
    """A prefill's GEMMs over float32 weights in bfloat16 (on) or float32: whether they now are (never without
    ``bf16_products``)."""
    global _bf16_gemm
    _bf16_gemm = on and bf16_products()
    return _bf16_gemm


def bf16_gemm() -> bool:
    return _bf16_gemm


def configured(module, precision: str):
    """``module`` running prefills at ``precision`` (prefill_precision's); the prefill GEMMs set to match."""
    bf16 = precision == "bf16"
    tiles, gemm = module.set_bf16_prefill(precision != "exact"), set_bf16_gemm(bf16)
    if precision == "auto":
        log.info("cpu prefill over quantized weights held interleaved: %s",
                 "AMX tiles in bfloat16" if tiles else "exact (no AMX tiles on this CPU or build)")
    if bf16 and not (tiles or gemm):
        log.warning("LMPORT_CPU_PREFILL=bf16: this CPU has no bfloat16 products (AMX or AVX512_BF16; or "
                    "LMPORT_CPU_ISA=avx2 is set); prefills stay exact")
    elif bf16 and not gemm:
        log.warning("LMPORT_CPU_PREFILL=bf16: this torch has no oneDNN: a prefill over weights held with their rows "
                    "interleaved takes AMX tiles; its GEMMs over float32 weights and over quantized weights expanded "
                    "to float32 stay float32")
    elif bf16 and not tiles:
        held = [f"int{bits}" for bits in module.quant_interleaved_bits()]
        held += [name.upper() for name in module.ggml_interleaved_types()]
        log.warning("LMPORT_CPU_PREFILL=bf16: this CPU (or build) has no AMX tiles: a prefill over the weights held "
                    "with their rows interleaved (%s; GGUF's Q4_0, Q4_1 and Q8_0 load as int4 and int8) stays "
                    "exact; its GEMMs over float32 weights and over the other quantized weights, expanded to "
                    "float32, take bfloat16", ", ".join(held))
    return module


@functools.cache
def load():
    """The compiled module, or None (the reason is logged once)."""
    if os.environ.get("LMPORT_CPU_KERNELS", "1") == "0":
        log.info("cpu kernels off (LMPORT_CPU_KERNELS=0): using the reference ops")
        return None
    isa = isa_flags()   # a bad LMPORT_CPU_ISA is the user's to fix, not a build failure to fall back from
    precision = prefill_precision()   # likewise LMPORT_CPU_PREFILL
    try:
        from torch.utils.cpp_extension import load as build
        log.info("loading the cpu kernels (built on first use, once per kind of CPU)")
        directory = build_directory()
        built = _load_built(directory)
        if built is not None:
            return configured(built, precision)
        module = build(build_name(), staged_sources(directory), extra_cflags=["-O3", *isa, "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory=str(directory))
        _mark_built(directory, Path(module.__file__))
        return configured(module, precision)
    except Exception as exc:  # any build failure leaves the reference ops in place
        log.warning("cpu kernels unavailable, using the reference ops: %s: %s", type(exc).__name__,
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None
