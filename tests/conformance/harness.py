"""How each installed backend is run by the conformance matrix on this machine.

``op_backend(name)`` returns (backend instance, mode) where mode is one of
"native" (the real device), "interpreter" (Triton kernels under
TRITON_INTERPRET=1 on CPU tensors) or "simulated" (a vendor SDK stand-in from
tests/simulated). Results in mode "simulated" are never results on hardware.
It calls ``pytest.skip`` when a backend cannot run its ops here at all.
"""
from __future__ import annotations

import pytest
import torch

from lmport import registry
from lmport.backend import Backend


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
    pytest.importorskip("triton")
    return cls(device="cpu"), "interpreter"


# Off-device runners by backend name; the vendor backends add theirs here.
_OFF_DEVICE = {
    "cuda": _cuda_interpreter,
}


def reference_device(backend: Backend) -> torch.device:
    return backend.device
