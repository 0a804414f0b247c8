"""benchmarks/guidellm_compare.py's table over rounds: each server's output tok/s and TTFT p50 as median (min-max),
the lmport / llama-server ratio taken round by round, and a run that errored in any round named, not averaged;
--rounds below one refused before any server starts."""
from __future__ import annotations

import subprocess
import sys

from benchmark_module import BENCHMARKS, load_benchmark


def run(rate: float, ttft: float) -> dict:
    return {"output_tokens_per_s": rate, "ttft_p50_ms": ttft, "itl_p50_ms": 1.0, "requests": 16, "errored": 0}


def test_rounds_are_medians_with_ratios_taken_round_by_round():
    compare = load_benchmark("guidellm_compare")
    rounds = {"lmport": [{"fresh, synchronous": run(r, t)} for r, t in ((6.0, 100), (3.0, 300), (8.0, 200))],
              "llama-server": [{"fresh, synchronous": run(r, t)} for r, t in ((4.0, 900), (1.0, 700), (2.0, 800))]}
    row = compare.table(rounds).splitlines()[2]
    # ratios 1.5, 3.0, 4.0 by round: their median, not 6.0 / 2.0
    assert row == ("| fresh, synchronous | 6.0 (3.0-8.0) | 200 (100-300) | 2.0 (1.0-4.0) | 800 (700-900) "
                   "| 3.00 (1.50-4.00) |")


def test_a_run_that_errored_in_any_round_shows_its_error():
    compare = load_benchmark("guidellm_compare")
    rounds = {"lmport": [{"fresh, synchronous": run(6.0, 100)}, {"fresh, synchronous": {"error": "guidellm exited 1"}}],
              "llama-server": [{"fresh, synchronous": run(4.0, 900)}, {"fresh, synchronous": run(2.0, 800)}]}
    row = compare.table(rounds).splitlines()[2]
    assert row == "| fresh, synchronous | guidellm exited 1 | - | 3.0 (2.0-4.0) | 850 (800-900) |"


def test_rounds_below_one_are_refused_before_any_server_starts():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "guidellm_compare.py"), "--rounds", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--rounds: '0': give a whole number of rounds, at least 1" in out.stderr
