"""benchmarks/kernel_ab.py: a --base that is not a checkout, one round, or a --files path with no GGUF file
refused before anything is measured; each round's ratio paired; another checkout's kernel sources built under a
name of their own; a worker whose engine fails a request stops with the error."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_module import load_benchmark
from lmport.backends.cpu import kernels
from lmport.engine.output_processor import RequestOutput

ROOT = Path(__file__).resolve().parents[1]


def test_a_base_without_kernel_sources_is_named_before_anything_runs(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_ab.py"), "--base", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--base {tmp_path}: give a checkout of lmport (one with lmport/backends/cpu/csrc)" in out.stderr


def test_one_round_or_a_missing_gguf_path_is_refused_before_anything_runs(tmp_path):
    script = [sys.executable, str(ROOT / "benchmarks" / "kernel_ab.py"), "--base", str(ROOT)]
    out = subprocess.run([*script, "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--rounds must be at least 2 (each build leads every other round)" in out.stderr
    missing = tmp_path / "nowhere.gguf"
    out = subprocess.run([*script, "--files", f"Q4_1,{missing}"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--files: no GGUF file at {missing}: give the path of one, or one of Q4_1" in out.stderr
    assert "round 1" not in out.stdout


def test_each_rounds_ratio_is_paired():
    kernel_ab = load_benchmark("kernel_ab")
    rounds = [{"A": {"prefill": 300.0, "decode@0": 100.0, "decode@256": 80.0},
               "B": {"prefill": 330.0, "decode@0": 110.0, "decode@256": 80.0}},
              {"A": {"prefill": 200.0, "decode@0": 50.0, "decode@256": 40.0},
               "B": {"prefill": 200.0, "decode@0": 60.0, "decode@256": 36.0}}]
    summary = kernel_ab.summary(rounds, "A", "B")
    assert summary["prefill"]["B / A"] == {"median": 1.05, "min": 1.0, "max": 1.1}
    assert summary["decode@0"]["B / A"] == {"median": 1.15, "min": 1.1, "max": 1.2}   # not 85 / 75
    assert summary["decode@256"]["B / A"] == {"median": 0.95, "min": 0.9, "max": 1.0}
    assert summary["decode@0"]["A"] == {"median": 75.0, "min": 50.0, "max": 100.0}


def test_other_sources_build_under_a_name_of_their_own(tmp_path, monkeypatch):
    other = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, other)
    same = kernels.source_tag()
    monkeypatch.setattr(kernels, "CSRC", other)
    assert kernels.source_tag() == same   # the same bytes: the same build
    with open(other / "isa" / "isa.h", "a") as f:   # a header in a folder counts as much as a source
        f.write("// another version\n")
    assert kernels.source_tag() != same
    assert kernels.source_tag() in kernels.build_name()
    staged = kernels.staged_sources(tmp_path / "build")
    assert (tmp_path / "build" / "csrc" / "isa" / "isa.h").read_text().endswith("// another version\n")
    assert staged == [str(tmp_path / "build" / "csrc" / name) for name in kernels.SOURCES]


def test_a_request_the_engine_failed_ends_the_worker():
    """A build that refuses this checkout's cache (one from before float16 caches, with the default
    --kv-cache-dtype) fails every forward; the worker stops with the error rather than timing the failures."""
    worker_process = load_benchmark("worker_process")

    class Engine:
        def __init__(self, error):
            self.error = error

        def step(self):
            return [RequestOutput(request_id="1", token_ids=[], text="", delta_token_ids=[], delta_text="",
                                  finished=True, finish_reason="error" if self.error else None, prompt_tokens=1,
                                  error=self.error)]

    worker_process.step(Engine(None))
    with pytest.raises(SystemExit, match="the engine ended a request with an error: forward failed: caches"):
        worker_process.step(Engine("forward failed: caches"))
