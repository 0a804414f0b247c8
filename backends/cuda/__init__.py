"""cuda backend: NVIDIA GPUs through torch.cuda, with Triton kernels for the hot ops.

Importing this module imports neither triton nor the kernels (reading the
capabilities must stay cheap and GPU-free). The kernel modules are imported
on the first op call; that is when their ``@triton.jit`` decorators run, so
``TRITON_INTERPRET=1`` must be set before then to run them on CPU tensors.
``CudaBackend(device="cpu")`` sets it (unless already set) for that reason.

Ops: fill_kv_cache, paged_attention (decode: split-K; otherwise prefill) are
Triton kernels; copy_blocks, rms_norm and apply_rotary are the reference
torch ops (see docs/cuda.md for why).
"""
from __future__ import annotations

import os

import torch

from lmport.backend import Backend, Capabilities, ProbeResult


def _kernels():
    """The Triton kernel modules, imported on first use."""
    try:
        from lmport.backends.cuda import decode_attention, kv_fill, launch, prefill_attention
    except ImportError as exc:
        raise ImportError(f"the cuda backend's kernels need triton ({exc}); "
                          f"install it with `pip install lmport[cuda]`") from exc
    return decode_attention, kv_fill, launch, prefill_attention


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

    def __init__(self, device: str | torch.device | None = None) -> None:
        super().__init__(device)
        if self.device.type == "cpu":
            # Kernels on CPU tensors only run under the Triton interpreter, which
            # is chosen when the kernel modules are imported (lazily, later).
            os.environ.setdefault("TRITON_INTERPRET", "1")
        self._ops = None

    def _kernel_ops(self):
        if self._ops is None:
            decode, fill, launch, prefill = _kernels()
            if self.device.type == "cpu" and not launch.INTERPRETED:
                raise RuntimeError("CudaBackend(device='cpu') needs the Triton interpreter, but the kernels "
                                   "were already imported without TRITON_INTERPRET=1; set it before "
                                   "anything imports lmport.backends.cuda's kernels")
            self._ops = (decode.decode_attention, fill.fill_kv_cache, prefill.prefill_attention)
        return self._ops

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def pin_host_memory(self) -> bool:
        return True

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # -- ops --------------------------------------------------------------
    def fill_kv_cache(self, k, v, cache, slot_mapping) -> None:
        self._kernel_ops()[1](k, v, cache, slot_mapping)

    def paged_attention(self, q, cache, meta, softmax_scale):
        decode, _, prefill = self._kernel_ops()
        return (decode if meta.is_decode else prefill)(q, cache, meta, softmax_scale)

    # copy_blocks, rms_norm, apply_rotary: the reference torch ops (docs/cuda.md says why).
