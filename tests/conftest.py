"""The test session's setup: the Triton interpreter switch, exact cpu prefills, the background subprocesses started once
collection is done (tests/support/background_runs.py), tokenizers read once a worker
(tests/support/tokenizer_memo.py), and the shared fixtures (tests/support/fixtures.py; the vision families' ``hf``
and ``llm`` from tests/support/vision_helpers.py).

Helper modules live in tests/support/ (on the path as ``support``, tests/ being on it).
"""
from __future__ import annotations

import os

import pytest
import torch

from support import tokenizer_memo
from support.background_runs import background
from support.fixtures import (backends_output, backends_table, broken_plugin_backends_output,  # noqa: F401
                              freeze_discovery, fresh_interpreter, install_fake_plugin, parse_backends, repo_root)
from support.vision_helpers import hf, llm  # noqa: F401  (over the requesting module's model_dir)

# Without a GPU the cuda backend's Triton kernels run on CPU tensors under the interpreter. Triton reads the
# switch when the kernels are first imported, so the test session sets it here, before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The cpu kernels' prefills compute exactly (x to 16 bits, the weights' codes exact) whatever the CPU: the tests
# compare them, and greedy tokens over them, with references at float32 precision. The default, bfloat16 on AMX
# tiles where the CPU has them, is tested where a test asks for it (tests/conformance/test_quant_linear.py's
# cpu_prefill).
os.environ.setdefault("LMPORT_CPU_PREFILL", "exact")

# pytest-xdist workers share the machine's cores: each worker's torch threads (and the servers and background runs
# it starts, through OMP_NUM_THREADS) take its share, since torch's default of one thread a core in every worker
# oversubscribes the cores and its threads then spend much of the run waiting on one another.
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

tokenizer_memo.install()


def _uses_background(item) -> bool:
    return any(name in background.names for name in getattr(item, "fixturenames", ()))


# pyproject.toml gives each test 120 s; a slow-marked case (make test-all) may take up to this, unless it names its own.
SLOW_TIMEOUT_S = 900


def pytest_collection_modifyitems(session, config, items):
    # The tests that wait for a background subprocess go last, giving it time to finish.
    items.sort(key=_uses_background)
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def pytest_collection_finish(session):
    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    for name in background.names:
        if name in wanted:
            background.start(name)


def pytest_sessionfinish(session, exitstatus):
    background.close()
