"""The GPU kit (tools/gpu/) cannot rot: its dry run passes here, and its summary reads what it wrote."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "tools" / "gpu"


@pytest.mark.slow
def test_dry_run_lists_every_step(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(KIT / "run.py"), "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--site", str(tmp_path / "site"),
                           "--cache", str(tmp_path / "cache"), "--budget", "1200"],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "run.json", "run.md"]
    run = json.loads((out / "run.json").read_text())
    status = {r["step"]: r["status"] for r in run["steps"]}
    assert list(status) == ["install", "env", "conformance", "parity", "graphs", "plan", "kernels", "throughput",
                            "quant", "limits"]
    # Without a GPU each GPU step is skipped with its reason (after its toy-size run), never failed.
    assert all(s == "passed" for k, s in status.items() if k in ("install", "env")), run["steps"]
    for r in run["steps"][2:]:
        assert r["status"] == "skipped" and "needs a CUDA GPU" in r["reason"] and r["seconds"] > 0, r
    summary = subprocess.run([sys.executable, str(KIT / "summary.py"), str(out)], capture_output=True, text=True,
                             check=True).stdout
    assert "| conformance | skipped |" in summary and "Dry run" in summary


def test_steps_cover_the_issue_list():
    sys.path.insert(0, str(KIT))
    try:
        import run as kit_run
        import steps as kit_steps
    finally:
        sys.path.remove(str(KIT))
    assert [s[0] for s in kit_run.STEPS] == list(kit_steps.STEPS)


def test_summary_merges_calls(tmp_path):
    """Two device calls' folders: a step that ran wins over the same step skipped in the other call."""
    sys.path.insert(0, str(KIT))
    try:
        import summary
    finally:
        sys.path.remove(str(KIT))
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, steps in ((a, [{"step": "env", "status": "passed", "seconds": 1, "data": {"device_name": "GPU X"}},
                               {"step": "graphs", "status": "skipped", "seconds": 0, "reason": "budget"}]),
                          (b, [{"step": "graphs", "status": "passed", "seconds": 9, "data": {
                              "identity": [{"model": "llama", "dtype": "float32", "batch": 3, "identical": True}],
                              "timing": [{"model": "default", "batch": 1, "eager_ms": 4.0, "graphs_ms": 1.0,
                                          "speedup": 4.0}]}}])):
        folder.mkdir()
        (folder / "run.json").write_text(json.dumps({"steps": steps, "dry_run": False}))
    text = summary.render(*summary.load([a, b]))
    assert "Measured on GPU X" in text and "| graphs | passed | 9 |" in text
    assert "| default | 1 | 4.0 | 1.0 | 4.0 |" in text
