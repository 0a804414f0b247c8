"""A script of benchmarks/ imported as a module, for tests of its parts."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))   # its own imports are the benchmarks' modules
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))
