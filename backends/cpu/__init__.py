"""cpu backend: the reference ops on host memory."""
from __future__ import annotations

from lmport.backend import Backend, Capabilities, ProbeResult


class CpuBackend(Backend):
    capabilities = Capabilities(
        device_type="cpu",
        torch_device="cpu",
        kv_quant_policies=frozenset({0, 4, 8}),
        default_block_size=16,
        dist_backend="gloo",
        priority=0,
        default_dtype="float32",
        # Host RAM is shared with everything else on the machine: take a smaller share.
        default_cache_max_entry_count=0.05,
    )

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "always available (reference ops on host memory)")
