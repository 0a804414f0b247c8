"""The front end's handle on an engine core in its own process (lmport.engine.client)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.model_helpers import tiny_model_dir


def test_a_message_longer_than_the_pipe_holds_does_not_block_the_event_loop_while_the_core_steps(tmp_path):
    """The core reads its pipe between steps. A message posted while it is in a long step (here held until the
    test releases it) must not hold the event loop that posted it: the server's other requests and /health run
    on that loop (tests/support/held_core.py, in a fresh interpreter)."""
    script = Path(__file__).parent / "support" / "held_core.py"
    done = subprocess.run([sys.executable, str(script), str(tiny_model_dir("llama")), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
