"""benchmarks/single_stream.py refuses a --files path that is not a GGUF file before it builds or measures."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_gguf_path_is_named_before_anything_runs(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "single_stream.py"), "--files", f"Q4_1,{missing}",
                          "--llama-bin", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"--files: no GGUF file at {missing}: give the path of one, or one of Q4_1" in out.stderr
    assert "llama-bench" not in out.stderr   # found before the llama.cpp build is looked for
