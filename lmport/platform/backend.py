"""What a backend is: its capabilities (data) and its ops (reference by default).

A backend subclass declares ``capabilities`` as a class attribute, so reading
it never needs the vendor SDK. Vendor imports happen in ``probe()`` and in
``__init__`` (instantiation on a device). Every op defaults to the pure-PyTorch
reference in ``lmport.ops``; a backend overrides only what it accelerates.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import psutil
import torch

from lmport import ops
from lmport.kv.layout import LayerCache
from lmport.ops import gated_delta_net
from lmport.weights import fp8, row_range
from lmport.weights.ggml import dequantize_mxfp4


# Attention variants a model may need (lmport.models.architectures.attention_variants): "sinks", a learned
# logit per head in each softmax's denominator (gpt-oss); "chunked", each token attending within its own
# chunk of positions (Llama 4's local layers); "latent", multi-head latent attention over a paged latent cache
# (DeepSeek-V3's MLA: ``fill_latent_cache`` and ``latent_attention``); "recurrent_state", linear-attention layers
# keeping a fixed-size state per sequence instead of paged K/V (Qwen3-Next's Gated DeltaNet:
# lmport.ops.gated_delta_net, in the slots of lmport.kv.state_pool); "bidirectional", spans of a prefill whose
# tokens also see the later tokens of their span (Gemma 3's images: AttentionMetadata.bidirectional).
ATTENTION_VARIANTS = ("sinks", "chunked", "latent", "recurrent_state", "bidirectional")


@dataclass(frozen=True)
class Capabilities:
    device_type: str
    torch_device: str
    kv_quant_policies: frozenset[int]
    default_block_size: int
    dist_backend: str
    priority: int
    # Block-size rule: a forced value wins; otherwise sizes >= block_size_min,
    # powers of two when block_size_power_of_two.
    block_size_forced: int | None = None
    block_size_min: int = 1
    block_size_power_of_two: bool = False
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")
    default_dtype: str = "float16"
    default_cache_max_entry_count: float = 0.8
    # Dtypes an unquantized K/V cache may be kept in besides the model's own (EngineConfig.kv_cache_dtype),
    # which the backend's fill and attention ops read and write. Empty: the model's dtype only.
    kv_cache_dtypes: frozenset[str] = frozenset()
    # The float8 formats a KV cache may be kept in (EngineConfig.quant_policy="fp8": "e4m3", lmport.kv.quant), read
    # and written by the backend's fill and attention ops; a config asking for one a backend lacks is refused before
    # any weight loads (lmport.platform.resolution). Empty: none.
    kv_fp8_formats: frozenset[str] = frozenset()
    # Axis order of each K/V cache block: "bshd" = [block, slot, head, dim].
    kv_axis_order: str = "bshd"
    # Quantized weight formats run natively (docs/weight-quantization.md): "int4", "int8", and the
    # group sizes (input elements sharing one scale and min) the kernels take. Empty: none.
    weight_formats: frozenset[str] = frozenset()
    weight_group_sizes: frozenset[int] = frozenset({32, 64, 128})
    # GGUF block types (lmport.weights.ggml.BLOCK_TYPES: "q4_k", "q6_k", ...) whose blocks the kernels
    # read as the file stores them. Empty: none.
    ggml_types: frozenset[str] = frozenset()
    # Scale layouts of float8 e4m3 weights (lmport.weights.fp8.SCALE_LAYOUTS: "tensor", "channel", "block") that
    # ``Backend.fp8_linear`` runs with the weights kept in fp8; a checkpoint of a layout a backend lacks is refused
    # before any weight loads unless weight_format="dequantize" (docs/weight-quantization.md). Empty: none.
    fp8_weight_scales: frozenset[str] = frozenset()
    # Whether ``Backend.decode_graphs`` captures decode steps (EngineConfig.eager_mode=False). Where it is False,
    # lmport.platform.resolution.resolve_config records an Adjustment (eager_mode False -> True) and every step runs
    # eagerly.
    decode_graphs: bool = False
    # Whether ``Backend.add_lora`` runs here: LoRA adapters served over the base model (EngineConfig.max_loras).
    lora: bool = False
    # Attention variants ``paged_attention`` honours beyond causal, sliding-window and soft-capped attention
    # (ATTENTION_VARIANTS; lmport.ops.AttentionMetadata): a model that needs one a backend lacks is refused
    # before any weight loads (lmport.platform.resolution.check_model). Empty: none.
    attention_variants: frozenset[str] = frozenset()
    # The Ray resource one tensor-parallel rank reserves in its placement-group bundle (docs/distributed.md):
    # "GPU" for cuda, a custom resource the cluster's nodes declare ("NPU", "MLU"), "CPU" for host memory.
    ray_resource: str = "CPU"

    def runs_kv_policy(self, quant_policy: int | str) -> bool:
        """Whether this backend keeps a KV cache under ``quant_policy`` (0, 8, 4 or "fp8")."""
        if quant_policy == "fp8":
            return "e4m3" in self.kv_fp8_formats
        return quant_policy in self.kv_quant_policies

    def kv_policies_text(self) -> str:
        """The quant_policy values it runs: "0,4,8,fp8"."""
        fp8 = ["fp8"] if self.runs_kv_policy("fp8") else []
        return ",".join([str(p) for p in sorted(self.kv_quant_policies)] + fp8)

    def weight_format_problem(self, bits: int, group_size: int) -> str | None:
        """Why this backend cannot run int``bits`` weights in groups of ``group_size`` (None when it can)."""
        if f"int{bits}" not in self.weight_formats:
            runs = ", ".join(sorted(self.weight_formats)) or "no quantized weights"
            return f"it runs {runs}"
        if group_size not in self.weight_group_sizes:
            return f"its int{bits} kernels take group sizes {sorted(self.weight_group_sizes)}"
        return None

    def weight_formats_text(self) -> str:
        scales = "/".join(s for s in fp8.SCALE_LAYOUTS if s in self.fp8_weight_scales)
        fp8_text = [f"fp8 {scales}"] if scales else []
        if not self.weight_formats:
            return ", ".join(fp8_text) or "-"
        ints = ",".join(sorted(self.weight_formats)) + " g" + "/".join(map(str, sorted(self.weight_group_sizes)))
        return ", ".join([ints, *fp8_text])

    def block_size_rule(self) -> str:
        if self.block_size_forced is not None:
            return f"forced {self.block_size_forced}"
        if self.block_size_power_of_two:
            return f"power of two >= {self.block_size_min}"
        return f"any >= {self.block_size_min}"

    def block_size_problem(self, block_size: int) -> str | None:
        """Why ``block_size`` breaks the rule (None when it is allowed).

        A forced size is not a problem: the resolved config overrides it.
        """
        if self.block_size_forced is not None:
            return None
        if block_size < self.block_size_min:
            return f"must be >= {self.block_size_min}"
        if self.block_size_power_of_two and block_size & (block_size - 1):
            return "must be a power of two"
        return None


class DecodeGraphs(Protocol):
    """Captured decode steps (``Backend.decode_graphs``): a batch of n sequences runs as the smallest captured
    batch size >= n, its extra rows padded (they write no cache slot and their output is dropped)."""

    batch_sizes: tuple[int, ...]

    def takes(self, num_seqs: int, max_blocks: int) -> bool:
        """Whether a decode batch of ``num_seqs`` sequences, the longest holding ``max_blocks`` blocks, replays."""
        ...

    def run(self, input_ids: torch.Tensor, meta: ops.AttentionMetadata) -> torch.Tensor:
        """The step's output rows for the batch's sequences (a view, valid until the next run)."""
        ...


# A decode forward: token ids [B] and the step's metadata -> logits [B, vocab].
DecodeStep = Callable[[torch.Tensor, ops.AttentionMetadata], torch.Tensor]


@dataclass(frozen=True)
class ProbeResult:
    available: bool
    reason: str


class Backend:
    """Base class of every backend; the ops here are the reference ones."""

    capabilities: ClassVar[Capabilities]

    @classmethod
    def probe(cls) -> ProbeResult:
        """Whether this backend can run here, and why. Must never raise."""
        return ProbeResult(True, "reference ops on torch")

    def __init__(self, device: str | torch.device | None = None) -> None:
        # ``device`` overrides the torch device, e.g. "cpu" to run Triton kernels
        # under the interpreter or a vendor backend against a simulated SDK.
        self.device = torch.device(device or self.capabilities.torch_device)

    @classmethod
    def setup_rank(cls, local_rank: int, local_world: int) -> str:
        """The torch device of tensor-parallel rank ``local_rank`` among ``local_world`` ranks on one host
        (one device each); a backend may also share what the ranks of a host share (cpu: its cores)."""
        return f"{cls.capabilities.torch_device}:{local_rank}"

    # -- memory ---------------------------------------------------------
    # The torch device namespace (torch.cuda, torch.npu, torch.mlu) a device backend sets in
    # ``__init__``; None means the tensors live in host memory.
    device_module = None

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device memory the KV cache can use."""
        if self.device_module is None:
            mem = psutil.virtual_memory()
            return mem.available, mem.total
        return self.device_module.mem_get_info(self.device)

    def measure_peak_memory(self, fn) -> int | None:
        """Peak device bytes allocated while ``fn()`` runs, above what was allocated before, with the
        memory ``fn`` freed handed back to the device; None where the backend cannot measure it (then
        ``fn`` is not run and the engine uses an estimate of the activation reserve)."""
        return None

    def release_idle_memory(self) -> None:
        """Called when the engine has had no work for a while, and at load once the tokenizer is built: give back to
        the system the memory a host allocator holds freed (a step's activations, the tokenizer's temporaries).
        Default: nothing."""

    def prepare(self) -> None:
        """Called once a rank's model is loaded, before the engine serves: what the ops need and the backend
        makes on first use (compiled kernels) is made now, so that no request waits on it. Default: nothing."""

    def pin_host_memory(self) -> bool:
        """Whether the host pool of the prefix cache should be pinned."""
        return self.device_module is not None and self.device.type != "cpu"

    def synchronize(self) -> None:
        if self.device_module is not None:
            self.device_module.synchronize(self.device)

    # -- ops (reference implementations; override to accelerate) --------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T (+ bias); the result may be in any strided layout (the model does not assume contiguity)."""
        return torch.nn.functional.linear(x, weight, bias)

    def quant_linear(self, x: torch.Tensor, weight: ops.QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ dequantize(weight)^T (+ bias) for a weight in the internal quantized format."""
        return ops.quant_linear(x, weight, bias)

    def ggml_linear(self, x: torch.Tensor, weight: ops.GGMLWeight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ dequantize(weight)^T (+ bias) for a weight held in its GGUF blocks."""
        return ops.ggml_linear(x, weight, bias)

    def fp8_linear(self, x: torch.Tensor, weight: fp8.Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ dequantize(weight)^T (+ bias) for float8 e4m3 weights with block scales (lmport.weights.fp8); run
        only for the scale layouts ``capabilities.fp8_weight_scales`` declares."""
        return fp8.fp8_linear(x, weight, bias)

    def quantized_linear(self, x: torch.Tensor, weight: ops.QuantizedWeight | ops.GGMLWeight | fp8.Fp8Weight
                         ) -> torch.Tensor:
        """x @ weight^T through this backend's linear for the weight's kind; MXFP4 blocks where ``capabilities``
        declare no kernel for them by their torch reference (lmport.weights.ggml.REFERENCE_BLOCK_TYPES)."""
        if isinstance(weight, ops.GGMLWeight) and weight.type_name == "mxfp4" and \
                "mxfp4" not in self.capabilities.ggml_types:
            return torch.nn.functional.linear(x, dequantize_mxfp4(weight, x.dtype))
        if isinstance(weight, ops.GGMLWeight):
            return self.ggml_linear(x, weight)
        if isinstance(weight, fp8.Fp8Weight):
            return self.fp8_linear(x, weight)
        return self.quant_linear(x, weight)

    def quant_embedding(self, ids: torch.Tensor, weight: ops.QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of an embedding table in the internal quantized format, as ``dtype``
        [*ids.shape, in_features]; the table in any layout ``hold_quantized`` gave it (a tied LM head's)."""
        return ops.quant_embedding(ids, weight, dtype)

    def ggml_embedding(self, ids: torch.Tensor, weight: ops.GGMLWeight, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of an embedding table held in its GGUF blocks, as ``quant_embedding``."""
        return ops.ggml_embedding(ids, weight, dtype)

    def hold_quantized(self, weight: ops.QuantizedWeight | ops.GGMLWeight,
                       dtype: torch.dtype) -> ops.QuantizedWeight | ops.GGMLWeight:
        """A linear's quantized weight (int4 / int8, or GGUF blocks) in the layout this backend's kernels read
        it in, for activations of ``dtype``; asked once the model is loaded (lmport.weights.interleaved). The
        weight handed in is not used after: its tensors may be relaid in place. Default: as it is."""
        return weight

    def hold_experts(self, experts: ops.QuantizedExperts, dtype: torch.dtype) -> ops.QuantizedExperts:
        """Routed experts' stacked weights in the layout this backend's kernels read them in, as ``hold_quantized``
        holds a linear's, each expert's rows still a slice of the whole; the weights handed in are not used after.
        Default: as they are."""
        return experts

    def hold_heads(self, weight: ops.QuantizedWeight | ops.GGMLWeight, heads: int,
                   dtype: torch.dtype) -> ops.QuantizedWeight | ops.GGMLWeight:
        """A per-head projection's quantized weight (``head_linear``'s) in the layout this backend's kernels read
        it in, each head's rows still a slice of the whole; the weight handed in is not used after. Default: as
        it is."""
        return weight

    def fill_kv_cache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                      slot_mapping: torch.Tensor) -> None:
        ops.fill_kv_cache(k, v, cache, slot_mapping)

    def paged_attention(self, q: torch.Tensor, cache: LayerCache, meta: ops.AttentionMetadata,
                        softmax_scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``new_kv``: the step's K and V as fill_kv_cache took them; over a quantized cache the step's tokens
        attend to these, not to their quantized copies (lmport.ops.attention)."""
        return ops.paged_attention(q, cache, meta, softmax_scale, new_kv)

    def fill_latent_cache(self, latent: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
        """A "latent" layer's new tokens [T, width] into its cache (lmport.ops.mla); the "latent" variant."""
        ops.fill_latent_cache(latent, cache, slot_mapping)

    def latent_attention(self, q_lat: torch.Tensor, q_rope: torch.Tensor, cache: LayerCache,
                         meta: ops.AttentionMetadata, softmax_scale: float,
                         new_latent: torch.Tensor | None = None) -> torch.Tensor:
        """Multi-head latent attention over a "latent" cache with the projections absorbed (lmport.ops.mla):
        q_lat [T, H, rank], q_rope [T, H, rope] -> [T, H, rank]; ``new_latent``: the step's latents as
        fill_latent_cache took them, read instead of their quantized copies."""
        return ops.latent_attention(q_lat, q_rope, cache, meta, softmax_scale, new_latent)

    def head_linear(self, x: torch.Tensor,
                    weight: torch.Tensor | ops.QuantizedWeight | ops.GGMLWeight) -> torch.Tensor:
        """x [T, H, in] -> [T, H, out]: head h's inputs through its own rows [h * out, (h + 1) * out) of ``weight``
        [H * out, in] (MLA's absorbed projections, lmport.ops.mla), float or quantized (as ``hold_heads`` held it):
        each head's rows through ``quantized_linear``."""
        if isinstance(weight, torch.Tensor):
            return ops.head_linear(x, weight)
        heads = x.shape[1]
        rows = weight.out_features // heads
        return torch.stack([self.quantized_linear(x[:, h].contiguous(), row_range(weight, h * rows, (h + 1) * rows))
                            for h in range(heads)], dim=1)

    def recurrent_gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, state: torch.Tensor | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule token by token over a batch of sequences (lmport.ops.gated_delta_net: q, k
        [B, T, Hk, Dk], v [B, T, Hv, Dv], g and beta [B, T, Hv], ``state`` [B, Hv, Dk, Dv] or None; the output in
        v's dtype and the float32 state after): a decode step of the "recurrent_state" variant's layers."""
        return gated_delta_net.recurrent_gated_delta_rule(q, k, v, g, beta, state)

    def recurrent_gated_delta_rule_in_place(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                            g: torch.Tensor, beta: torch.Tensor, pool: torch.Tensor,
                                            slots: torch.Tensor) -> torch.Tensor:
        """``recurrent_gated_delta_rule`` for sequences whose states are the rows ``slots`` (int64 [B]) of ``pool``
        [rows, Hv, Dk, Dv]: returns the output and leaves each sequence's state after its tokens in its row.
        Here: the rows gathered, the op, the rows written back; a backend may update them where they lie."""
        out, state = self.recurrent_gated_delta_rule(q, k, v, g, beta, pool[slots])
        pool[slots] = state.to(pool.dtype)
        return out

    def chunk_gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over a prefill (chunk) of a sequence: the arguments and results of
        ``recurrent_gated_delta_rule``, the same within rounding; the reference computes it in chunks of tokens."""
        return gated_delta_net.chunk_gated_delta_rule(q, k, v, g, beta, state)

    def copy_blocks(self, src: list[LayerCache], dst: list[LayerCache],
                    src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        ops.copy_blocks(src, dst, src_ids, dst_ids)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ops.rms_norm(x, weight, eps)

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.apply_rotary(q, k, cos, sin)

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(gate, up)

    def fused_moe(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' gated MLPs summed with their routing weights (lmport.ops.moe)."""
        return ops.fused_moe(x, gate_up, down, weights, ids)

    def clamped_swiglu_moe(self, x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor,
                           down: torch.Tensor, down_bias: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                           alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's routed experts (lmport.ops.moe.clamped_swiglu_moe)."""
        return ops.clamped_swiglu_moe(x, gate_up, gate_up_bias, down, down_bias, weights, ids, alpha, limit)

    def input_scaled_moe(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor) -> torch.Tensor:
        """Llama 4's routed experts, the routing weight scaling each expert's input (lmport.ops.moe)."""
        return ops.input_scaled_moe(x, gate_up, down, weights, ids)

    def quantized_moe(self, x: torch.Tensor, experts: ops.QuantizedExperts, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        """Routed experts over quantized weights (a GGUF's, ``ops.QuantizedExperts``) summed with their routing
        weights. Here: each expert that has tokens in turn, its projections by ``quantized_linear``; it reads each
        expert's token count on the host."""
        return ops.quantized_moe(x, experts, weights, ids, self.quantized_linear, self.silu_and_mul)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 batch: ops.LoraBatch) -> torch.Tensor:
        """``y`` plus each row's own adapter update (lmport.ops.lora): rows of several adapters and of the base
        model in one batch."""
        return ops.add_lora(y, x, lora_a, lora_b, batch)

    def decode_graphs(self, step: DecodeStep, max_batch_size: int, max_blocks_per_seq: int,
                      block_size: int) -> DecodeGraphs | None:
        """Decode steps of up to ``max_batch_size`` sequences of up to ``max_blocks_per_seq`` blocks, captured
        once the model and the KV cache exist (EngineConfig.eager_mode=False; ``capabilities.decode_graphs``
        says whether a backend does). ``step`` reads its inputs only through its arguments. None: every step
        runs eagerly."""
        return None

    def decoder_runner(self, layers: list[ops.DecoderLayerSpec]) -> ops.DecoderRunner | None:
        """A function that runs a step through all of ``layers`` at once (lmport.ops.decoder), or None:
        the model's modules then call this backend's ops one by one, which is always correct."""
        return None
