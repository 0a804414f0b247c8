"""Llama 4 text (transformers' ``llama4_text``): the Llama-family decoder with chunked local attention,
NoPE layers and interleaved mixture-of-experts MLPs.

What differs, each as transformers' Llama4Text modules compute it:
- rope layers (``no_rope_layers[i]`` = 1) attend within their chunk of ``attention_chunk_size``
  positions (``layer_types`` "chunked_attention"): the "chunked" attention variant a backend declares
  (lmport.ops.AttentionMetadata.chunk); every ``no_rope_layer_interval``-th layer takes no rotary and
  attends to everything;
- rope layers normalize q and k per head after rotary (an L2 norm without weight, ``use_qk_norm``);
  NoPE layers scale q by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 at position p
  (``attn_temperature_tuning``);
- transformers rotates interleaved pairs of a head (dimensions 2i and 2i + 1, as complex numbers); the q and k
  projections' rows are reordered at load (each head's even dimensions, then its odd ones) so that lmport's
  "rotate half" rotary computes the same rotation; attention scores are unchanged by that reordering (q and k
  alike), and so are the L2 norm and the temperature;
- the ``moe_layers`` have a router picking the top ``num_experts_per_tok`` experts by sigmoid, whose weight
  scales the expert's input (lmport.ops.moe.input_scaled_moe), plus a shared expert every token runs; the other
  layers' MLP is ``intermediate_size_mlp`` wide. The MLP is ``feed_forward`` in the checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport import ops
from lmport.platform.backend import Backend
from lmport.kv.layout import LayerCache
from lmport.models.layers import RMSNorm, apply_rope
from lmport.models.llama import MLP, Attention, PagedCausalLM, no_rope_layers
from lmport.models.moe import refuse_tp
from lmport.models.quantized import QuantExperts
from lmport.parallel import TPGroup

LLAMA4_MODEL_TYPES = ("llama4_text",)


def chunked_layers(cfg) -> list[bool]:
    """Per layer, whether it attends within its chunk of ``attention_chunk_size`` positions."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return [t == "chunked_attention" and bool(cfg.attention_chunk_size) for t in types[:cfg.num_hidden_layers]]


class Llama4Attention(Attention):
    def __init__(self, cfg, backend: Backend, tp: TPGroup, index: int):
        super().__init__(cfg, backend, tp)
        self.use_rope = not no_rope_layers(cfg)[index]
        self.l2_qk_norm = bool(cfg.use_qk_norm) and self.use_rope
        self.eps = cfg.rms_norm_eps
        self.chunk = cfg.attention_chunk_size if chunked_layers(cfg)[index] else None
        self.temperature = (float(cfg.floor_scale), float(cfg.attn_scale)) \
            if cfg.attn_temperature_tuning and not self.use_rope else None

    def _l2(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def forward(self, x, cos, sin, cache: LayerCache, meta: ops.AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.use_rope:
            q, k = apply_rope(self.backend, q, k, cos, sin)
        if self.l2_qk_norm:
            q, k = self._l2(q), self._l2(k)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((meta.positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        self.backend.fill_kv_cache(k, v, cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, cache, self.layer_meta(meta), self.scale, new_kv=(k, v))
        return self.o_proj.forward(out.reshape(x.shape[0], self.num_heads * self.head_dim))

    def layer_meta(self, meta: ops.AttentionMetadata) -> ops.AttentionMetadata:
        return meta.for_layer(meta.window, meta.softcap, meta.sinks, self.chunk)


class Llama4Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, backend: Backend):
        super().__init__()
        self.backend = backend
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.input_scaled_moe(x, self.gate_up_proj, self.down_proj, weights, ids)

    def quantized_experts(self, gate, up, down, backend: Backend) -> nn.Module:
        """The twin of these experts over quantized gate, up and down weights as a GGUF stacks them."""
        num_experts, hidden, gate_up = self.gate_up_proj.shape
        for name, w, want in (("gate_proj", gate, (gate_up // 2, hidden)), ("up_proj", up, (gate_up // 2, hidden)),
                              ("down_proj", down, (hidden, gate_up // 2))):
            if (w.out_features, w.in_features) != (num_experts * want[0], want[1]):
                raise ValueError(f"experts.{name}: quantized experts are [{w.out_features}, {w.in_features}] but "
                                 f"the model config makes them {num_experts} x {list(want)}")
        return QuantExperts(gate, up, down, num_experts, backend, scale_inputs=True)


class Llama4Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class Llama4Moe(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.router = Llama4Router(cfg.num_local_experts, cfg.hidden_size)
        self.experts = Llama4Experts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, backend)
        self.shared_expert = MLP(cfg, backend, tp, cfg.intermediate_size)
        self.top_k = cfg.num_experts_per_tok
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.route_top_k_sigmoid(self.backend.linear(x, self.router.weight), self.top_k)
        routed = self.experts.forward(x, weights, ids)
        return self.shared_expert.forward(x) + routed


class Llama4DecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = Llama4Attention(cfg, backend, tp, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.feed_forward: nn.Module = Llama4Moe(cfg, backend, tp) if index in cfg.moe_layers else \
            MLP(cfg, backend, tp, cfg.intermediate_size_mlp)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, cache, meta)
        return x + self.feed_forward.forward(self.post_attention_layernorm.forward(x))


def interleaved_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A q or k projection's rows (or bias) with each head's dimensions reordered from interleaved pairs
    (0, 1, 2, 3, ...) to halves (0, 2, 4, ..., 1, 3, 5, ...)."""
    heads = w.unflatten(0, (-1, head_dim // 2, 2))
    return heads.transpose(1, 2).flatten(0, 2)


class Llama4CausalLM(PagedCausalLM):
    model_types = LLAMA4_MODEL_TYPES

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        refuse_tp(cfg, tp)
        super().__init__(cfg, backend, rotary, tp)
        self.model.layers = nn.ModuleList(Llama4DecoderLayer(cfg, backend, self.tp, i)
                                          for i in range(cfg.num_hidden_layers))

    @classmethod
    def attention_variants(cls, cfg) -> set[str]:
        return {"chunked"} if any(chunked_layers(cfg)) else set()

    def layer_rope_kinds(self, cfg) -> list[str | None]:
        return [None] * cfg.num_hidden_layers   # a NoPE layer skips rotary itself (it is not applied after)

    def rope_rows(self, kind, x, meta):
        # transformers' module gives each position's rotation as complex numbers over half a head
        freqs = self.rotary(x, meta.positions[None])[0]
        cos, sin = freqs.real.to(x.dtype), freqs.imag.to(x.dtype)
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        d = self.model.layers[0].self_attn.head_dim
        turned = {name: interleaved_to_halves(t, d) if name.endswith(("q_proj.weight", "k_proj.weight",
                                                                       "q_proj.bias", "k_proj.bias")) else t
                  for name, t in full.items()}
        return super().shard_state_dict(turned)
