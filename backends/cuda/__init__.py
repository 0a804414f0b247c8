"""cuda backend: NVIDIA GPUs through torch.cuda."""
from __future__ import annotations

import torch

from lmport.backend import Backend, Capabilities, ProbeResult


class CudaBackend(Backend):
    capabilities = Capabilities(
        device_type="cuda",
        torch_device="cuda",
        kv_quant_policies=frozenset({0, 4, 8}),
        default_block_size=64,
        block_size_min=16,
        block_size_power_of_two=True,
        dist_backend="nccl",
        priority=100,
        default_dtype="bfloat16",
    )

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            if not torch.cuda.is_available():
                return ProbeResult(False, "no CUDA device: torch.cuda.is_available() is False")
            return ProbeResult(True, f"{torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}")
        except Exception as exc:
            return ProbeResult(False, f"torch.cuda failed: {exc}")

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def pin_host_memory(self) -> bool:
        return True

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
