"""The GGUF files the CPU benchmarks run: the default model's shipped Q4_1 and the same weights requantized by
llama.cpp's `llama-quantize --allow-requantize IN OUT TYPE` (made once, then reused), and the random-weight files
in the shapes of 3B-8B models (benchmarks/sized_files.py: `qwen2.5-7b-Q4_K_M` and the like)."""
from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import sized_files

DEFAULT_DIR = Path.home() / ".cache" / "lmport-files"
# Where a llama.cpp build's bin directory is looked for unless LMPORT_LLAMA_CPP_BIN or --llama-bin says.
DEFAULT_LLAMA_BIN = Path(os.environ.get("LMPORT_LLAMA_CPP_BIN", Path.home() / ".cache" / "llamacpp" / "build" / "bin"))
TYPES = ("Q4_1", "Q8_0", "Q4_K_M")
# lmport's kv_cache_dtype in the benchmarks against llama.cpp: the cache llama.cpp keeps by default (its
# --cache-type-k / --cache-type-v f16), so both engines read the same bytes of history a token.
KV_CACHE_DTYPE = "float16"


def gguf_file(kind: str, files_dir: Path = DEFAULT_DIR, llama_bin: Path | None = None) -> Path:
    """The default model as ``kind`` (one of TYPES): the shipped file for Q4_1, else
    ``files_dir/smollm2-KIND.gguf``, made with llama-quantize from ``llama_bin`` when missing."""
    from lmport.models.loader import resolve_model_path
    if kind in sized_files.NAMES:
        return sized_files.sized_file(kind, files_dir, llama_bin or sized_files.DEFAULT_LLAMA_BIN)
    shipped = resolve_model_path("smollm2")
    if kind == "Q4_1":
        return shipped
    if kind not in TYPES:
        raise SystemExit(f"unknown file type {kind!r}: one of {', '.join(TYPES)}, or a sized file "
                         f"(SHAPE-TYPE: {', '.join(sized_files.NAMES)})")
    target = files_dir / f"smollm2-{kind}.gguf"
    if target.exists():
        return target
    quantize = None if llama_bin is None else llama_bin / "llama-quantize"
    if quantize is None or not quantize.exists():
        raise SystemExit(f"{target} is missing and no llama-quantize to make it with: pass --llama-bin")
    files_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.stem}.partial.gguf")
    subprocess.run([str(quantize), "--allow-requantize", str(shipped), str(partial), kind], check=True,
                   capture_output=True)
    partial.rename(target)
    return target


def check_paths(names: list[str]) -> None:
    """Refuse a name in ``--files`` that is a path (``.gguf``) with no file there, before anything runs."""
    for name in names:
        if name.endswith(".gguf") and not Path(name).is_file():
            raise SystemExit(f"--files: no GGUF file at {name}: give the path of one, or one of {', '.join(TYPES)}")


def files_by_label(names: list[str], files_dir: Path, llama_bin: Path | None) -> dict[str, Path]:
    """``--files`` as label -> GGUF file: a path's file name, or a type of the default model (gguf_file)."""
    check_paths(names)
    return {Path(name).name if name.endswith(".gguf") else name:
            Path(name) if name.endswith(".gguf") else gguf_file(name, files_dir, llama_bin) for name in names}


def add_kv_cache_dtype_argument(ap: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype``: lmport's cache, one of EngineConfig's kv_cache_dtypes (a typo refused before anything
    runs), KV_CACHE_DTYPE unless given."""
    from lmport.config import KV_CACHE_DTYPES
    ap.add_argument("--kv-cache-dtype", default=KV_CACHE_DTYPE, choices=KV_CACHE_DTYPES,
                    help=f"lmport's kv_cache_dtype (default {KV_CACHE_DTYPE}, as llama.cpp's default f16 cache)")
