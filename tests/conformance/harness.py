"""How each installed backend is run by the conformance matrix on this machine.

``op_backend(name)`` returns (backend instance, mode) where mode is one of
"native" (the real device), "interpreter" (Triton kernels under
TRITON_INTERPRET=1 on CPU tensors) or "simulated" (a vendor SDK stand-in from
tests/simulated). Results in mode "simulated" are never results on hardware.
It calls ``pytest.skip`` when a backend cannot run its ops here at all.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lmport.platform import registry
from lmport.platform.backend import Backend


def op_backend(name: str) -> tuple[Backend, str]:
    cls = registry.load_backend_class(name)
    probe = registry.safe_probe(cls)
    if probe.available:
        return cls(), "native"
    runner = _OFF_DEVICE.get(name)
    if runner is None:
        pytest.skip(f"{name}: not available here ({probe.reason}) and no off-device runner")
    return runner(cls)


def _cuda_interpreter(cls) -> tuple[Backend, str]:
    # Look triton up without importing it: tests/conftest.py sets TRITON_INTERPRET before the kernels load.
    if importlib.util.find_spec("triton") is None:
        pytest.skip("cuda: triton is not installed, so its kernels cannot run under the interpreter")
    return cls(device="cpu"), "interpreter"


def simulated_backend(cls) -> tuple[Backend, str]:
    """A vendor backend on CPU tensors against its simulated SDK (tests/simulated), mode "simulated".

    The simulated modules are in sys.modules only while the backend is built; the
    instance keeps its own references to them, so nothing leaks into other tests.
    """
    tests_dir = str(Path(__file__).resolve().parents[1])
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    simulated = importlib.import_module("simulated")
    with simulated.installed(cls.capabilities.device_type):
        return cls(device="cpu"), "simulated"


# Off-device runners by backend name; the vendor backends add theirs here.
_OFF_DEVICE = {
    "cuda": _cuda_interpreter,
    "ascend": simulated_backend,
    "camb": simulated_backend,
}


def reference_device(backend: Backend) -> torch.device:
    return backend.device


class _ReferenceCalled(Exception):
    pass


def own_result(backend: Backend, op: str, *args):
    """``backend.<op>(*args)``, or None where the backend hands these inputs to the reference op (``lmport.ops.<op>``):
    such a cell compares the reference with itself, so the caller skips it as not applicable."""
    from lmport import ops

    def reference(*_args, **_kwargs):
        raise _ReferenceCalled
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, op, reference)
        try:
            return getattr(backend, op)(*args)
        except _ReferenceCalled:
            return None
