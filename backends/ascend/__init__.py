"""ascend backend: Huawei Ascend NPUs through torch_npu."""
from __future__ import annotations

import importlib

from lmport.backend import Backend, Capabilities, ProbeResult


class AscendBackend(Backend):
    capabilities = Capabilities(
        device_type="ascend",
        torch_device="npu",
        kv_quant_policies=frozenset({0, 4, 8}),
        default_block_size=128,
        block_size_min=16,
        block_size_power_of_two=True,
        dist_backend="hccl",
        priority=90,
        default_dtype="float16",
    )

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            torch_npu = importlib.import_module("torch_npu")
        except Exception as exc:
            return ProbeResult(False, f"torch_npu not importable: {type(exc).__name__}: {exc}")
        try:
            import torch
            if not torch.npu.is_available():
                return ProbeResult(False, "torch_npu imported but torch.npu.is_available() is False")
            return ProbeResult(True, f"torch_npu {getattr(torch_npu, '__version__', '?')}, "
                                     f"{torch.npu.device_count()} NPU(s)")
        except Exception as exc:
            return ProbeResult(False, f"torch.npu failed: {exc}")
