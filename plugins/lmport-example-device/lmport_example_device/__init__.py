"""A fictional device "example": no KV quantization, block size fixed at 32.

It shows everything a vendor writes for a new device: Capabilities as data,
a probe, and (here) no op overrides at all, so it runs on the reference ops
in host memory. A real plugin sets ``device_module`` (its torch device
namespace, for memory queries and synchronization) in ``__init__`` and
overrides ``fill_kv_cache``, ``paged_attention`` and friends with its own kernels.
"""
from __future__ import annotations

from lmport.platform.backend import Backend, Capabilities, ProbeResult


class ExampleBackend(Backend):
    capabilities = Capabilities(
        device_type="example",
        torch_device="cpu",
        kv_quant_policies=frozenset({0}),
        default_block_size=32,
        block_size_forced=32,
        dist_backend="gloo",
        priority=-10,
        default_dtype="float32",
        default_cache_max_entry_count=0.1,
    )

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "simulated on the host CPU")
