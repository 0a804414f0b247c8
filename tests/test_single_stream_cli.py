"""benchmarks/single_stream.py: a --files path that is not a GGUF file, a --kv-cache-dtype EngineConfig does not take,
or an --llama-avx2-bin without llama-bench, refused before anything is built or measured; the table's ratios, the
AVX2 path's against a llama.cpp without AVX-512 too."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmark_module import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_gguf_path_is_named_before_anything_runs(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "single_stream.py"), "--files", f"Q4_1,{missing}",
                          "--llama-bin", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--files: no GGUF file at {missing}: give the path of one, or one of Q4_1" in out.stderr
    assert "llama-bench" not in out.stderr   # found before the llama.cpp build is looked for


def test_a_kv_cache_dtype_engine_config_does_not_take_is_refused_before_anything_runs(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "single_stream.py"), "--kv-cache-dtype", "f16",
                          "--llama-bin", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--kv-cache-dtype: invalid choice: 'f16' (choose from" in out.stderr
    assert "llama-bench" not in out.stderr


def test_an_avx2_peer_without_llama_bench_is_named_before_anything_runs(tmp_path):
    native, empty = tmp_path / "native", tmp_path / "empty"
    native.mkdir()
    empty.mkdir()
    (native / "llama-bench").touch()   # only looked for here: nothing runs it before the refusal
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "single_stream.py"), "--files", "Q4_1",
                          "--llama-bin", str(native), "--llama-avx2-bin", str(empty)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--llama-avx2-bin: no llama-bench in {empty}" in out.stderr


def test_the_avx2_path_is_also_set_against_llama_cpp_without_avx512(capsys):
    single_stream = load_benchmark("single_stream")
    keys = single_stream.measures(single_stream.DEFAULT_LENGTHS)
    speeds = {"llama.cpp": 100.0, single_stream.AVX2_PEER: 80.0, "lmport": 150.0, "lmport avx2": 120.0}
    summary = {engine: {k: {"median": v, "min": v, "max": v} for k in keys}
               for engine, v in speeds.items()}
    results = {"machine": {"model": "cpu", "cores": 2, "kernel_flags": ["avx2"], "load_average": (0, 0, 0)},
               "bandwidth": {"best_gbs": 30.0, "method": "m", "threads": 2}, "bandwidth_after": {"best_gbs": 30.0},
               "load_average_after": (0, 0, 0), "repeats": 5,
               "llama_cpp": {"version": "v", "bin": "b", "cmake_args": "a"},
               "peers": {"llama.cpp": {"bin": "b", "version": "v"},
                         single_stream.AVX2_PEER: {"bin": "c", "version": "v"}},
               "files": {"Q4_1": {"gguf_tensor_bytes": 10**8, "summary": summary, "lmport": {
                   "lmport": {"weight_bytes": 1}, "lmport avx2": {"weight_bytes": 1}},
                   "rounds": [{engine: {"threads": 2, **{k: v for k in keys}}
                               for engine, v in speeds.items()},
                              {engine: {"threads": 2, **{k: v * (2 if engine == "lmport" else 1)
                                                         for k in keys}}
                               for engine, v in speeds.items()}]}}}
    single_stream.print_table(results)
    ratios = results["files"]["Q4_1"]["ratios_over_llama_cpp"]
    assert ratios["lmport"]["decode@0"] == 1.5
    assert ratios["lmport avx2"]["decode@0"] == 1.2
    assert ratios[f"lmport avx2 / {single_stream.AVX2_PEER}"]["decode@0"] == 1.5
    # round by round: lmport's second round twice its first against the same llama.cpp, 1.5x and 3.0x
    per_round = results["files"]["Q4_1"]["ratios_round_by_round"]
    assert per_round["lmport"]["decode@0"] == {"median": 2.25, "min": 1.5, "max": 3.0}
    out = capsys.readouterr().out
    assert "| Q4_1 | lmport avx2 / llama.cpp avx2 | | 1.50x | 1.50x | 1.50x | |" in out
    assert "| Q4_1 | lmport / llama.cpp, round by round | | 2.25x (1.50-3.00) |" in out
