"""A decoder layer (the Llama family, Qwen3, Gemma 2 and 3) described as data, for backends that run
a step's layers themselves (``Backend.decoder_runner``) instead of the model's modules calling their
ops one by one.

A decode step of a small model spends much of its time between the weight reads: a 30-layer model
makes about 400 op calls a token, each through a module, a backend method and its checks. A
backend that knows the layers' weights up front can run them in a tight loop of its own (the cpu
backend's Python loop over its compiled kernels; CUDA graphs would be the same idea on cuda).

What one layer computes, with ``x`` the step's hidden states [T, hidden] and ``[...]`` what only
some architectures have (Qwen3's and Gemma 3's per-head q/k norms, Gemma's norms on the attention's
and the MLP's outputs)::

    q, k, v = split(qkv(rms_norm(x, attention_norm)), heads)   # [T, heads, head_dim] each
    [q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)]
    q, k = rotary(q, k, the layer's cos/sin); fill the KV cache with k, v
    h = o(paged_attention(q, cache, scale))
    [h = rms_norm(h, attention_output_norm)]
    x = x + h
    gate, up = halves of gate_up(rms_norm(x, mlp_norm))
    h = down(act(gate) * up)              # act: silu, or gelu with the tanh approximation
    [h = rms_norm(h, mlp_output_norm)]
    x = x + h

A norm's weight is the scale it applies (Gemma's stored weight plus one).
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
class Norm:
    weight: torch.Tensor   # the scale applied
    eps: float


ACTIVATIONS = ("silu", "gelu_tanh")   # what a spec's MLP may apply to gate


@dataclass(frozen=True)
class DecoderLayerSpec:
    attention_norm: Norm
    qkv: Linears               # q's rows, then k's, then v's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float               # the attention's softmax scale
    o: Linears
    mlp_norm: Norm
    gate_up: Linears           # gate's rows, then up's
    down: Linears
    activation: str = "silu"   # one of ACTIVATIONS
    q_norm: Norm | None = None                  # over each head of q and k, before rotary
    k_norm: Norm | None = None
    attention_output_norm: Norm | None = None   # over the attention's output, before the residual sum
    mlp_output_norm: Norm | None = None         # over the MLP's output, before the residual sum

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"decoder layer activation {self.activation!r}: one of {', '.join(ACTIVATIONS)}")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("a decoder layer normalizes both q and k per head, or neither")


# (x, each layer's (cos, sin), each layer's cache, each layer's metadata) -> x after every layer, or
# None where the runner does not cover this step (the model's modules then run it).
DecoderRunner = Callable[[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], list[LayerCache],
                          list[AttentionMetadata]], torch.Tensor | None]
