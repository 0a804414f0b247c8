"""GGUF files made by llama.cpp's own tools, loaded by lmport and compared with transformers (slow).

Where llama.cpp is found:

- ``LMPORT_LLAMA_CPP_DIR``: a llama.cpp source directory (the one with ``convert_hf_to_gguf.py`` and
  ``gguf-py/``), its tools in ``build/bin`` under it, or in ``LMPORT_LLAMA_CPP_BIN`` where that is set
  (the variable benchmarks/single_stream.py reads);
- otherwise the layout llama-cpp-python's source build leaves: the source at
  ``/root/.cache/llamacpp/llama_cpp_python-*/vendor/llama.cpp`` and the tools at
  ``/root/.cache/llamacpp/build/bin``.

Without ``llama-quantize`` and ``convert_hf_to_gguf.py`` (and the converter's own requirement
``sentencepiece``, which it imports even for byte-level BPE vocabularies) the tests are skipped, saying so.

Files:

- tiny random-weight Gemma 3, Qwen3, Phi-3 and Qwen3-MoE models (tests/support/tiny_hf_models.py) saved
  as transformers directories, converted with ``convert_hf_to_gguf.py --outtype f16`` (run with this
  environment's python; the script imports its own gguf-py), then ``llama-quantize`` to Q4_K_M, Q5_K_M
  and Q6_K;
- the default model requantized: ``llama-quantize --allow-requantize IN OUT Q4_K_M`` (and Q5_K_M, Q6_K).

For each file: lmport's greedy tokens (cpu, float32 compute, the file's weights as they are) against
transformers loading the same file, 16 prompts x 32 tokens decoded together and each alone (one row
a step: the single-stream kernels), at least 15 of 16 identical either way; the weight
bytes lmport holds at most 1.1x the file's tensor bytes. And llama.cpp itself runs the files
tests/support/gguf_files.py writes (``llama-bench -p 4 -n 4``).

The files are made once into lmport's cache directory (``test-models/llama-cpp-*``).
"""
from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import greedy
from support.saved_dirs import own_tmp
from support.tiny_hf_models import ARCHS, gguf_file, tiny_config, tiny_model_dir

pytestmark = pytest.mark.slow

TINY_ARCHS = ("gemma3", "qwen3", "phi3", "qwen3-moe")
PRESETS = ("Q4_K_M", "Q5_K_M", "Q6_K")
PROMPTS, NEW_TOKENS = 16, 32


def llama_cpp() -> tuple[Path | None, Path | None]:
    """(source directory, bin directory) of a llama.cpp build, or Nones."""
    if source := os.environ.get("LMPORT_LLAMA_CPP_DIR"):
        src = Path(source)
        bins = Path(os.environ.get("LMPORT_LLAMA_CPP_BIN") or src / "build" / "bin")
        return src, bins
    found = sorted(glob.glob("/root/.cache/llamacpp/llama_cpp_python-*/vendor/llama.cpp"))
    src = Path(found[-1]) if found else None
    bins = Path(os.environ.get("LMPORT_LLAMA_CPP_BIN") or "/root/.cache/llamacpp/build/bin")
    return src, bins


def _tool(name: str) -> Path:
    src, bins = llama_cpp()
    if name == "convert_hf_to_gguf.py":
        path = src / name if src else None
    else:
        path = bins / name if bins else None
    if path is None or not path.exists():
        pytest.skip(f"llama.cpp's {name} not found (set LMPORT_LLAMA_CPP_DIR to a llama.cpp source directory "
                    f"with its tools built in build/bin; looked in {src} and {bins})")
    # The converter imports sentencepiece before it looks for a tokenizer.model (Qwen2/Qwen3: try
    # sentencepiece, else BPE); it is in llama.cpp's requirements, not in lmport's.
    if name == "convert_hf_to_gguf.py" and subprocess.run([sys.executable, "-c", "import sentencepiece"],
                                                          capture_output=True).returncode:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py needs its requirements importable (sentencepiece: "
                    "pip install sentencepiece, or put it on PYTHONPATH)")
    return path


def _run(argv: list, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def _out_dir() -> Path:
    from lmport.models.loader import cache_root
    d = cache_root() / "test-models" / "llama-cpp-v1"
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.cache
def converted_f16(arch: str) -> Path:
    """``tiny_model_dir(arch)`` through llama.cpp's convert_hf_to_gguf.py, F16."""
    convert = _tool("convert_hf_to_gguf.py")
    out = _out_dir() / f"tiny-{arch}-{Path(tiny_model_dir(arch)).name}-F16.gguf"
    if not out.exists():
        tmp = own_tmp(out)
        # --model-name: llama.cpp keys per-token attributes on general.name (one with "phi3" in it must have
        # Phi-3's SentencePiece tokens), which the converter otherwise takes from the directory's name
        _run([sys.executable, convert, tiny_model_dir(arch), "--outtype", "f16", "--outfile", tmp,
              "--model-name", "tiny-random"])
        tmp.replace(out)
    return out


@functools.cache
def quantized(source: Path, preset: str, requantize: bool = False) -> Path:
    """``llama-quantize [--allow-requantize] SOURCE OUT PRESET``."""
    out = _out_dir() / f"{source.stem.removesuffix('-F16')}-{preset}.gguf"
    if not out.exists():
        tmp = own_tmp(out)
        flags = ["--allow-requantize"] if requantize else []
        _run([_tool("llama-quantize"), *flags, source, tmp, preset])
        tmp.replace(out)
    return out


def _file(model: str, preset: str) -> Path:
    if model == "default":
        from lmport.models.loader import resolve_model_path
        return quantized(resolve_model_path("smollm2"), preset, requantize=True)
    return quantized(converted_f16(model), preset)


def _check(path: Path, model_type: str | None, prompt_lengths=(1, 7, 33, 90)):
    import lmport
    from lmport import EngineConfig
    ids = greedy.prompts(PROMPTS, lengths=prompt_lengths)
    want = greedy.hf_greedy(greedy.reference_model(str(path), model_type), ids, NEW_TOKENS)
    cfg = EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=256)
    with lmport.pipeline(str(path), backend_config=cfg) as pipe:
        greedy.check_file(pipe, path, ids, want, NEW_TOKENS)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_converted_and_quantized_by_llama_cpp(arch, preset):
    _check(_file(arch, preset), tiny_config(arch).model_type)


@pytest.mark.parametrize("preset", PRESETS)
def test_default_model_requantized_by_llama_cpp(preset):
    _check(_file("default", preset), None, prompt_lengths=(5, 12, 40, 100))


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_runs_the_files_written_here(arch):
    """llama.cpp loads each file tests/support/gguf_files.py writes and generates from it."""
    bench = _tool("llama-bench")
    proc = _run([bench, "-p", "4", "-n", "4", "-t", "2", "-m", gguf_file(arch)], timeout=300)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|") and ("pp4" in line or "tg4" in line)]
    assert len(rows) == 2, proc.stdout
