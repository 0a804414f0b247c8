"""Stand-ins for the vendor SDKs, for testing the ascend and camb backends without the hardware.

``installed("ascend")`` puts a simulated ``torch_npu`` (and ``torch.npu``) in
place, ``installed("camb")`` a simulated ``torch_mlu``, ``torch_mlu_ops`` (and
``torch.mlu``); both restore whatever was there before on exit. A backend
instantiated inside the block keeps its references to the simulated modules,
so the block only needs to cover the instantiation.

The simulated operators run on CPU tensors. They implement only the operators
the backends call, from the vendors' documented semantics (argument names,
layouts, dtypes and the shape checks the documentation states, raising as the
real ones do), and are written without lmport's reference ops so that a test
comparing the two compares two independent implementations. Anything a
backend passes that the simulation does not model raises NotImplementedError
instead of being silently ignored. Results obtained against these modules are
simulated results, never results on hardware.

Each simulated module records the operators called in its ``calls`` list
(name, keyword summary), which tests use to check that a backend really ran
the vendor operator rather than a fallback.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from . import torch_mlu_ops_sim, torch_mlu_sim, torch_npu_sim

# device -> ({module name: simulated module}, (torch attribute, simulated device namespace))
_SIMULATIONS = {
    "ascend": ({"torch_npu": torch_npu_sim}, ("npu", torch_npu_sim.npu)),
    "camb": ({"torch_mlu": torch_mlu_sim, "torch_mlu_ops": torch_mlu_ops_sim}, ("mlu", torch_mlu_sim.mlu)),
}


@contextmanager
def installed(device: str):
    """Install the simulated SDK of ``device`` ("ascend" or "camb") for the duration of the block."""
    modules, (attr, namespace) = _SIMULATIONS[device]
    saved_modules = {name: sys.modules.get(name) for name in modules}
    missing = object()
    saved_attr = torch.__dict__.get(attr, missing)
    sys.modules.update(modules)
    setattr(torch, attr, namespace)
    try:
        yield
    finally:
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if saved_attr is missing:
            delattr(torch, attr)
        else:
            setattr(torch, attr, saved_attr)


def module(device: str):
    """The main simulated module of ``device`` (the one whose ``calls`` record the vendor ops)."""
    return torch_npu_sim if device == "ascend" else torch_mlu_ops_sim
