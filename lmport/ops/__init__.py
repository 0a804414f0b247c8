"""Reference ops in pure PyTorch: the ground truth for every backend.

Tensor conventions (T = new tokens in the step, B = sequences):
q [T, Hq, D]; k, v [T, Hkv, D]; caches as in ``lmport.kv.layout``, in the "bshd" order only
(``LayerCache.axis_order``; the ops refuse another).
"""
from lmport.ops.metadata import AttentionMetadata, build_attention_metadata, host_tensor
from lmport.ops.kv_fill import fill_kv_cache
from lmport.ops.attention import paged_attention, gather_kv
from lmport.ops.mla import fill_latent_cache, head_linear, latent_attention
from lmport.ops.block_copy import copy_blocks
from lmport.ops.norm import rms_norm
from lmport.ops.rotary import apply_rotary
from lmport.ops.activation import silu_and_mul
from lmport.ops.moe import (QuantizedExperts, clamped_swiglu_moe, fused_moe, input_scaled_moe, moe_by_expert,
                            quantized_moe, route, route_grouped, route_top_k_sigmoid, route_top_k_softmax)
from lmport.ops.quant_linear import dequantize, quant_embedding, quant_linear
from lmport.ops.ggml import dequantize_ggml, ggml_embedding, ggml_linear
from lmport.ops.lora import LoraBatch, add_lora, build_lora_batch
from lmport.ops.decoder import DecoderLayerSpec, DecoderRunner, Linears, LinearWeights, Norm
from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import GGMLWeight

__all__ = [
    "AttentionMetadata", "build_attention_metadata", "host_tensor", "fill_kv_cache", "paged_attention",
    "gather_kv", "fill_latent_cache", "head_linear", "latent_attention", "copy_blocks", "rms_norm", "apply_rotary",
    "silu_and_mul",
    "fused_moe", "moe_by_expert", "QuantizedExperts", "quantized_moe", "route",
    "route_grouped", "route_top_k_softmax", "clamped_swiglu_moe", "route_top_k_sigmoid", "input_scaled_moe",
    "QuantizedWeight", "dequantize", "quant_linear", "quant_embedding",
    "GGMLWeight", "dequantize_ggml", "ggml_linear", "ggml_embedding", "DecoderLayerSpec", "DecoderRunner",
    "LinearWeights", "Linears", "Norm", "LoraBatch", "add_lora", "build_lora_batch",
]
