"""A decoder layer of the Llama family described as data, for backends that run a step's layers
themselves (``Backend.decoder_runner``) instead of the model's modules calling their ops one by one.

A decode step of a small model spends much of its time between the weight reads: a 30-layer model
makes about 400 op calls a token, each through a module, a backend method and its checks. A
backend that knows the layers' weights up front can run them in a tight loop of its own (the cpu
backend's Python loop over its compiled kernels; CUDA graphs would be the same idea on cuda).

What one layer computes, with ``x`` the step's hidden states [T, hidden]::

    q, k, v = split(qkv(rms_norm(x, input_norm)), heads)       # [T, heads, head_dim] each
    q, k = rotary(q, k); fill the KV cache with k, v
    x = x + o(paged_attention(q, cache, scale))
    gate, up = halves of gate_up(rms_norm(x, post_attention_norm))
    x = x + down(silu(gate) * up)

The model's modules (lmport.models.llama) stay the reference: a runner must give what they give.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmport.kv.layout import LayerCache
from lmport.ops.metadata import AttentionMetadata
from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import GGMLWeight


@dataclass(frozen=True)
class LinearWeights:
    weight: torch.Tensor | QuantizedWeight | GGMLWeight   # [out, in] float, the int4/int8 format, or GGUF blocks
    bias: torch.Tensor | None


# One projection: a linear, or linears of different formats whose outputs are concatenated.
Linears = LinearWeights | tuple[LinearWeights, ...]


@dataclass(frozen=True)
class DecoderLayerSpec:
    input_norm: torch.Tensor
    input_norm_eps: float
    qkv: Linears               # q's rows, then k's, then v's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float                     # the attention's softmax scale
    o: Linears
    post_attention_norm: torch.Tensor
    post_attention_norm_eps: float
    gate_up: Linears           # gate's rows, then up's
    down: Linears


# (x, cos, sin, each layer's cache, each layer's metadata) -> x after every layer, or None where
# the runner does not cover this step (the model's modules then run it).
DecoderRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[LayerCache], list[AttentionMetadata]],
                         torch.Tensor | None]
