"""cuda backend: NVIDIA GPUs through torch.cuda, with Triton kernels for the hot ops.

Importing this module imports neither triton nor the kernels (reading the
capabilities must stay cheap and GPU-free). The kernel modules are imported
on the first op call; that is when their ``@triton.jit`` decorators run, so
``TRITON_INTERPRET=1`` must be set before then to run them on CPU tensors:
the process that wants the interpreter sets it (the tests do, in tests/conftest.py);
``CudaBackend(device="cpu")`` without it fails on its first op, naming the fix.

Ops: fill_kv_cache, paged_attention (decode: split-K; otherwise prefill),
fill_latent_cache and latent_attention (MLA: absorbed multi-query attention over the latents),
recurrent_gated_delta_rule and chunk_gated_delta_rule (the linear-attention layers' gated delta rule: token by
token for decode and short prefills, in chunks of tokens with matmuls for longer ones),
quant_linear, ggml_linear (GGUF blocks dequantized in registers), fp8_linear (float8 e4m3 weights
with block scales, decoded in registers),
fused_moe (a grouped GEMM over the experts) and add_lora (a grouped GEMM over the
LoRA adapters of a batch) are Triton kernels; copy_blocks,
rms_norm and apply_rotary are the reference
torch ops (see docs/cuda.md for why).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from lmport import ops
from lmport.platform.backend import Backend, Capabilities, ProbeResult
from lmport.kv.layout import LayerCache
from lmport.weights import fp8


def _load_kernels(device: torch.device) -> SimpleNamespace:
    """The Triton kernel entry points, imported on first use."""
    try:
        from lmport.backends.cuda import (decode_attention, fp8_linear, gated_delta_net, ggml_linear, kv_fill,
                                          launch, lora, mla, moe, prefill_attention, quant_linear)
    except ImportError as exc:
        raise ImportError(f"the cuda backend's kernels need triton ({exc}); "
                          f"install it with `pip install lmport[cuda]`") from exc
    if device.type == "cpu" and not launch.INTERPRETED:
        raise RuntimeError("CudaBackend(device='cpu') needs the Triton interpreter, but the kernels were "
                           "imported without TRITON_INTERPRET=1; set it before anything imports them")
    return SimpleNamespace(fill_kv_cache=kv_fill.fill_kv_cache,
                           decode_attention=decode_attention.decode_attention,
                           prefill_attention=prefill_attention.prefill_attention,
                           quant_linear=quant_linear.quant_linear,
                           ggml_linear=ggml_linear.ggml_linear,
                           fp8_linear=fp8_linear.fp8_linear,
                           fused_moe=moe.fused_moe,
                           clamped_swiglu_moe=moe.clamped_swiglu_moe,
                           input_scaled_moe=moe.input_scaled_moe,
                           add_lora=lora.add_lora,
                           fill_latent_cache=mla.fill_latent_cache,
                           latent_attention=mla.latent_attention,
                           recurrent_gated_delta_rule=gated_delta_net.recurrent_gated_delta_rule,
                           prefill_gated_delta_rule=gated_delta_net.prefill_gated_delta_rule)


class CudaBackend(Backend):
    capabilities = Capabilities(
        device_type="cuda",
        torch_device="cuda",
        kv_quant_policies=frozenset({0, 4, 8}),
        # An fp8 KV cache is only stored as float8: the Triton kernels encode and decode its bytes with integer
        # and fp32 arithmetic (kv_fill.py, paged_kv.py) and attend in the model's dtype, so it needs no fp8 hardware
        # (sm89+ is for fp8 matmuls, which attention here does not do) and runs on every GPU the kernels run on.
        kv_fp8_formats=frozenset({"e4m3"}),
        weight_formats=frozenset({"int4", "int8"}),
        # GGUF block types the Triton kernel reads as stored (lmport/backends/cuda/ggml_linear.py DEQUANTIZE).
        ggml_types=frozenset({"q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl", "iq4_xs"}),
        # fp8 weights in every scale layout (fp8_linear.py): decoded to float32 in registers with integer
        # arithmetic, so they run on every GPU the kernels run on, not only on sm89+ (which fp8 matmuls need).
        fp8_weight_scales=frozenset({"tensor", "channel", "block"}),
        default_block_size=64,
        block_size_min=16,
        block_size_power_of_two=True,
        dist_backend="nccl",
        ray_resource="GPU",
        priority=100,
        default_dtype="bfloat16",
        decode_graphs=True,
        lora=True,
        # The Triton attention kernels take sinks and chunks; "latent" (MLA): absorbed multi-query attention over
        # the paged latent cache (mla.py); "recurrent_state" (Gated DeltaNet): the gated delta rule
        # (gated_delta_net.py), its conv1d window on the reference torch op; "bidirectional" (Gemma 3's image
        # spans, prefill steps only) on the reference paged attention.
        attention_variants=frozenset({"sinks", "chunked", "latent", "recurrent_state", "bidirectional"}),
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
        if self.device.type != "cpu":
            # Interpreter runs keep device_module None: their "device" memory is host memory.
            self.device_module = torch.cuda
        self._kernels: SimpleNamespace | None = None

    @property
    def kernels(self) -> SimpleNamespace:
        if self._kernels is None:
            self._kernels = _load_kernels(self.device)
        return self._kernels

    def measure_peak_memory(self, fn) -> int | None:
        if self.device.type != "cuda":  # interpreter runs on host memory: nothing to measure
            return None
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()  # so mem_get_info counts what fn freed as free again
        return peak

    # -- ops --------------------------------------------------------------
    def quant_linear(self, x: torch.Tensor, weight: ops.QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2:
            return super().quant_linear(x, weight, bias)
        return self.kernels.quant_linear(x, weight, bias)

    def ggml_linear(self, x: torch.Tensor, weight: ops.GGMLWeight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.type_name not in self.capabilities.ggml_types:
            return super().ggml_linear(x, weight, bias)
        y = self.kernels.ggml_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.reshape(*x.shape[:-1], weight.out_features)

    def fp8_linear(self, x: torch.Tensor, weight: fp8.Fp8Weight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.kernels.fp8_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.reshape(*x.shape[:-1], weight.out_features)

    def fill_kv_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                      slot_mapping: torch.Tensor) -> None:
        self.kernels.fill_kv_cache(k, v, cache, slot_mapping)

    def paged_attention(self, q: torch.Tensor, cache: LayerCache, meta: ops.AttentionMetadata,
                        softmax_scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if meta.bidirectional is not None:   # the Triton kernels know only causal rows
            return super().paged_attention(q, cache, meta, softmax_scale, new_kv)
        if meta.is_decode:
            return self.kernels.decode_attention(q, cache, meta, softmax_scale, new_kv=new_kv)
        return self.kernels.prefill_attention(q, cache, meta, softmax_scale, new_kv=new_kv)

    def fill_latent_cache(self, latent: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
        self.kernels.fill_latent_cache(latent, cache, slot_mapping)

    def latent_attention(self, q_lat: torch.Tensor, q_rope: torch.Tensor, cache: LayerCache,
                         meta: ops.AttentionMetadata, softmax_scale: float,
                         new_latent: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.latent_attention(q_lat, q_rope, cache, meta, softmax_scale, new_latent)

    def recurrent_gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, state: torch.Tensor | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.recurrent_gated_delta_rule(q, k, v, g, beta, state)

    def chunk_gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.prefill_gated_delta_rule(q, k, v, g, beta, state)

    def fused_moe(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.fused_moe(x, gate_up, down, weights, ids)

    def clamped_swiglu_moe(self, x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor,
                           down: torch.Tensor, down_bias: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                           alpha: float, limit: float) -> torch.Tensor:
        return self.kernels.clamped_swiglu_moe(x, gate_up, gate_up_bias, down, down_bias, weights, ids, alpha, limit)

    def input_scaled_moe(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.input_scaled_moe(x, gate_up, down, weights, ids)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 batch: ops.LoraBatch) -> torch.Tensor:
        return self.kernels.add_lora(y, x, lora_a, lora_b, batch)

    # copy_blocks, rms_norm, apply_rotary: the reference torch ops (docs/cuda.md says why).

    def decode_graphs(self, step, max_batch_size: int, max_blocks_per_seq: int, block_size: int):
        """CUDA graphs of the decode step (lmport/backends/cuda/graphs.py); off a GPU (device "cpu", the interpreter)
        nothing is captured and each step runs eagerly on the same padded buffers."""
        from lmport.backends.cuda.graphs import DecodeGraphRunner, graph_batch_sizes
        runner = DecodeGraphRunner(step, max_blocks_per_seq, block_size, self.device,
                                   graph_batch_sizes(max_batch_size))
        runner.capture()
        return runner
