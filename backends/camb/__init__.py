"""camb backend: Cambricon MLUs through torch_mlu."""
from __future__ import annotations

import importlib

from lmport.backend import Backend, Capabilities, ProbeResult


class CambBackend(Backend):
    capabilities = Capabilities(
        device_type="camb",
        torch_device="mlu",
        kv_quant_policies=frozenset({0}),
        default_block_size=16,
        block_size_forced=16,
        dist_backend="cncl",
        priority=80,
        default_dtype="float16",
        kv_axis_order="bhsd",
    )

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            torch_mlu = importlib.import_module("torch_mlu")
        except Exception as exc:
            return ProbeResult(False, f"torch_mlu not importable: {type(exc).__name__}: {exc}")
        try:
            import torch
            if not torch.mlu.is_available():
                return ProbeResult(False, "torch_mlu imported but torch.mlu.is_available() is False")
            return ProbeResult(True, f"torch_mlu {getattr(torch_mlu, '__version__', '?')}, "
                                     f"{torch.mlu.device_count()} MLU(s)")
        except Exception as exc:
            return ProbeResult(False, f"torch.mlu failed: {exc}")
