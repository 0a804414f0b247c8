"""How a vendor backend finds its device: its torch plugin imports, and torch then has the device."""
from __future__ import annotations

import importlib

import torch

from lmport.platform.backend import ProbeResult


def probe_torch_plugin(plugin: str, device: str, unit: str, also: tuple[str, ...] = ()) -> ProbeResult:
    """Available when the module ``plugin`` (and each of ``also``) imports and ``torch.<device>`` reports a device;
    otherwise the reason, naming what failed. ``unit``: what the count of devices is called ("NPU")."""
    try:
        module = importlib.import_module(plugin)
        for name in also:
            importlib.import_module(name)
    except Exception as exc:
        return ProbeResult(False, f"{exc.name if isinstance(exc, ImportError) and exc.name else plugin} not "
                                  f"importable: {type(exc).__name__}: {exc}")
    try:
        device_module = getattr(torch, device)
        if not device_module.is_available():
            return ProbeResult(False, f"{plugin} imported but torch.{device}.is_available() is False")
        return ProbeResult(True, f"{plugin} {getattr(module, '__version__', '?')}, "
                                 f"{device_module.device_count()} {unit}(s)")
    except Exception as exc:
        return ProbeResult(False, f"torch.{device} failed: {exc}")
