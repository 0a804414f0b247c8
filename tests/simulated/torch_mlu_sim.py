"""Simulated ``torch_mlu``: only what registers the device, i.e. the ``torch.mlu`` namespace.

The simulated device's memory is host memory; there is no MLU, so
``torch.mlu.is_available()`` is False and the camb probe reports it unavailable.
"""
from __future__ import annotations

import types

import psutil

__version__ = "simulated"

mlu = types.ModuleType("torch.mlu", "simulated torch.mlu (host memory, no device)")
mlu.is_available = lambda: False
mlu.device_count = lambda: 0
mlu.synchronize = lambda device=None: None


def _mem_get_info(device=None):
    mem = psutil.virtual_memory()
    return mem.available, mem.total


mlu.mem_get_info = _mem_get_info
