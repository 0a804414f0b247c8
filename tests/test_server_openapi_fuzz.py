"""schemathesis over the server's own /openapi.json (benchmarks/openapi_fuzz.py): every route, all checks, no
failure. Slow (a server and a few hundred requests); skipped where schemathesis is not installed in its own
environment (see the script's docstring).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMATHESIS = os.environ.get("LMPORT_SCHEMATHESIS", "/root/.venvs/outside/bin/schemathesis")

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not Path(SCHEMATHESIS).exists(), reason=f"schemathesis not installed at {SCHEMATHESIS}")
def test_schemathesis_finds_no_failure():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "openapi_fuzz.py"), "--max-examples", "20",
                           "--schemathesis", SCHEMATHESIS], capture_output=True, text=True, timeout=840, cwd=ROOT)
    summary = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, summary
