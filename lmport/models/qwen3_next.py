"""Qwen3-Next (transformers' ``qwen3_next``): Gated DeltaNet linear-attention layers between gated full-attention
layers (``config.layer_types``: three linear layers, then one full, in the released models), and a mixture of
experts with a shared expert.

What differs from the Llama-family decoder, each as transformers' Qwen3Next modules compute it:
- a full-attention layer's q_proj gives each head its query and an output gate side by side; the attention's
  output is multiplied by sigmoid(gate) before o_proj; q and k are RMS-normalized per head; rotary turns the first
  ``partial_rotary_factor`` of each head. These layers (only these) cache K/V in the paged cache;
- a linear-attention layer (lmport.ops.gated_delta_net; the delta rule through the backend's
  ``recurrent_gated_delta_rule`` for decode and ``chunk_gated_delta_rule`` for prefill, the reference ops unless
  it has kernels) keeps a fixed-size state per sequence instead: a conv
  window and a recurrent state matrix per value head, in the sequence's slot of the recurrent-state pool
  (lmport.kv.state_pool). The step hands the model each sequence's slot (``state_slots``); a sequence whose
  cached length before the step is 0 starts from zeros, so a preempted sequence recomputed from its first token
  rebuilds its state and never reads what its slot held before;
- every RMSNorm but the linear layers' gated one scales by 1 + weight;
- the sparse MLP adds a shared expert weighed by sigmoid(shared_expert_gate(x)) to the routed experts
  (softmax, top k, renormalized when ``norm_topk_prob``); ``mlp_only_layers`` keep a dense MLP.

Tensor parallelism is refused (the experts and the linear layers' heads are not sharded). A GGUF's linear layers
hold q/k/v and z as two projections (llama.cpp's regrouping; ``LLAMA_CPP_PROJECTIONS``), the same computation.
Qwen3.5 (lmport.models.qwen3_5) is this decoder with other projections and MLPs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmport import ops
from lmport.kv.layout import CacheKind, LayerCache
from lmport.kv.state_pool import RecurrentStateSpec, StateTensors
from lmport.models.dims import head_dim_of
from lmport.models.layers import Linear, RMSNorm, apply_rope
from lmport.models.llama import MLP, PagedCausalLM
from lmport.models.moe import SparseMoeBlock, is_sparse_layer, refuse_tp
from lmport.ops import gated_delta_net as gdn
from lmport.parallel import TPGroup, kv_heads_per_rank
from lmport.platform.backend import Backend

QWEN3_NEXT_MODEL_TYPES = ("qwen3_next",)
LINEAR, FULL = "linear_attention", "full_attention"
# config.linear_projections of a model loaded from a GGUF: the linear layers' projections as llama.cpp stores them
LLAMA_CPP_PROJECTIONS = "qkv_z_ba"
# The attention variant a backend runs the linear layers' recurrent state with (Capabilities.attention_variants).
RECURRENT_STATE = "recurrent_state"


def layer_types(cfg) -> list[str]:
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != cfg.num_hidden_layers or set(types) - {LINEAR, FULL}:
        raise ValueError(f"{cfg.model_type}: config.layer_types needs {cfg.num_hidden_layers} entries of "
                         f"{LINEAR!r} / {FULL!r}, got {types}")
    return types


def recurrent_state_spec(cfg, dtype: torch.dtype) -> RecurrentStateSpec:
    """One sequence's state over the linear layers: conv windows in ``dtype``, state matrices in float32."""
    key_dim = cfg.linear_key_head_dim * cfg.linear_num_key_heads
    return RecurrentStateSpec(
        num_layers=layer_types(cfg).count(LINEAR),
        conv_channels=2 * key_dim + cfg.linear_value_head_dim * cfg.linear_num_value_heads,
        conv_width=cfg.linear_conv_kernel_dim - 1, num_heads=cfg.linear_num_value_heads,
        key_dim=cfg.linear_key_head_dim, value_dim=cfg.linear_value_head_dim, conv_dtype=dtype)


class GatedAttention(nn.Module):
    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.backend = backend
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = d = head_dim_of(cfg)
        self.scale = d ** -0.5
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * d * 2, bias, backend)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias, backend)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias, backend)
        self.o_proj = Linear(self.num_heads * d, cfg.hidden_size, bias, backend)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, backend, offset=1.0)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, backend, offset=1.0)

    def forward(self, x, cos, sin, cache: LayerCache, meta: ops.AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj.forward(x).unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        k = self.k_proj.forward(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj.forward(x).unflatten(-1, (-1, self.head_dim)).contiguous()
        q, k = self.q_norm.forward(q.contiguous()), self.k_norm.forward(k)
        q, k = apply_rope(self.backend, q, k, cos, sin)
        self.backend.fill_kv_cache(k, v, cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, cache, meta, self.scale, new_kv=(k, v))
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj.forward(out)


class Conv1dWeight(nn.Module):
    """transformers' depthwise ``nn.Conv1d`` as its state dict holds it: ``weight`` [channels, 1, kernel]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gdn.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; ``forward`` reads and writes the step's sequences' slots of ``conv`` and ``state``
    (this layer's tensors of the pool, lmport.kv.state_pool.StateTensors)."""

    def __init__(self, cfg, backend: Backend):
        super().__init__()
        self.backend, self.model_type = backend, cfg.model_type
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{cfg.model_type}: linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        self.key_size, self.value_size = self.k_dim * self.num_k_heads, self.v_dim * self.num_v_heads
        # Value heads grouped by key head (transformers': value head j reads key head j // group), or tiled over
        # them (j reads j % key heads: llama.cpp's converter stores Qwen3.5's so; every value-head tensor alike)
        self.tiled_v_heads = bool(getattr(cfg, "linear_value_heads_tiled", False))
        conv_channels = 2 * self.key_size + self.value_size
        self.conv1d = Conv1dWeight(conv_channels, cfg.linear_conv_kernel_dim)
        # transformers' layout, or llama.cpp's (a GGUF's: lmport.weights.gguf_config sets the config's field)
        self.split_qkv_z = getattr(cfg, "linear_projections", None) == LLAMA_CPP_PROJECTIONS
        self.make_projections(cfg.hidden_size, backend)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_size, cfg.hidden_size, False, backend)

    def make_projections(self, hidden: int, backend: Backend) -> None:
        if self.split_qkv_z:
            self.in_proj_qkv = Linear(hidden, 2 * self.key_size + self.value_size, False, backend)
            self.in_proj_z = Linear(hidden, self.value_size, False, backend)
        else:
            self.in_proj_qkvz = Linear(hidden, 2 * self.key_size + 2 * self.value_size, False, backend)
        self.in_proj_ba = Linear(hidden, 2 * self.num_v_heads, False, backend)

    def split_projections(self, x: torch.Tensor):
        """transformers' ``fix_query_key_value_ordering``: the projections are grouped by key head, each group
        holding its q, k, and its value heads' v and z (and b, a). llama.cpp's converter regroups q/k/v/z into
        q/k/v in the conv's channel order (``attn_qkv``) and z (``attn_gate``), and keeps b/a grouped."""
        t, group = x.shape[0], self.num_v_heads // self.num_k_heads
        b, a = self.in_proj_ba.forward(x).view(t, self.num_k_heads, 2 * group).split([group, group], dim=-1)
        if self.split_qkv_z:
            z = self.in_proj_z.forward(x).unflatten(-1, (self.num_v_heads, self.v_dim))
            return self.in_proj_qkv.forward(x), z, b.reshape(t, -1), a.reshape(t, -1)
        qkvz = self.in_proj_qkvz.forward(x).view(t, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, group * self.v_dim, group * self.v_dim], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)   # the conv's channels
        return mixed, z.reshape(t, self.num_v_heads, self.v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor, meta: ops.AttentionMetadata, slots: list[int] | None,
                conv: torch.Tensor | None, state: torch.Tensor | None) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self.split_projections(x)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0, :]
        core = x.new_empty(t, self.num_v_heads, self.v_dim)
        starts = [0]
        for n in meta.q_lens_host:
            starts.append(starts[-1] + n)
        if starts[-1] != t:   # e.g. a captured decode graph's metadata, which keeps no host lengths
            raise ValueError(f"{self.model_type}: the linear-attention layers split the step by the sequences' "
                             f"lengths on the host (meta.q_lens_host: {meta.q_lens_host} for {t} tokens), which "
                             "a captured decode graph does not carry: run it eagerly (eager_mode=True)")
        fresh = [kv == q for q, kv in zip(meta.q_lens_host, meta.kv_lens_host)]   # nothing cached before the step
        if slots is None and not all(fresh):
            raise ValueError(f"{self.model_type}: a step continuing a sequence needs its recurrent-state slot "
                             "(state_slots); the model runner binds them")
        if slots is not None and (conv is None or len(slots) != len(fresh) or min(slots) < 0):
            raise ValueError(f"{self.model_type}: each sequence of the step needs a recurrent-state slot of a bound "
                             f"pool, got {slots} for {len(fresh)} sequences")
        decoding = [i for i, n in enumerate(meta.q_lens_host) if n == 1 and not fresh[i]]
        if decoding:   # one token each: batched over the sequences
            rows = torch.tensor([starts[i] for i in decoding], device=x.device)
            index = torch.tensor([slots[i] for i in decoding], device=x.device)   # pyright: ignore[reportOptionalSubscript]
            out, windows = gdn.causal_conv1d_step(mixed[rows], weight, conv[index])   # pyright: ignore[reportOptionalSubscript]
            o = self.backend.recurrent_gated_delta_rule_in_place(*self.heads(out[:, None]), g[rows][:, None],
                                                                 beta[rows][:, None], state, index)
            conv[index] = windows   # pyright: ignore[reportOptionalSubscript]
            core[rows] = o[:, 0].to(core.dtype)
        batched = set(decoding)
        for i, (lo, hi) in enumerate(zip(starts, starts[1:])):
            if i in batched:
                continue
            slot = None if slots is None else slots[i]
            window = None if fresh[i] or slot is None else conv[slot]   # pyright: ignore[reportOptionalSubscript]
            before = None if fresh[i] or slot is None else state[slot:slot + 1]   # pyright: ignore[reportOptionalSubscript]
            out, window = gdn.causal_conv1d(mixed[lo:hi], weight, window)
            o, s = self.backend.chunk_gated_delta_rule(*self.heads(out[None]), g[None, lo:hi], beta[None, lo:hi],
                                                       before)
            if slot is not None:
                conv[slot] = window.to(conv.dtype)   # pyright: ignore[reportOptionalSubscript,reportOptionalMemberAccess]
                state[slot] = s[0].to(state.dtype)   # pyright: ignore[reportOptionalSubscript,reportOptionalMemberAccess]
            core[lo:hi] = o[0].to(core.dtype)
        out = self.norm.forward(core, z).reshape(t, self.value_size)
        return self.out_proj.forward(out)

    def heads(self, mixed: torch.Tensor):
        """q, k [B, T, key heads, Dk] and v [B, T, value heads, Dv] of the conv's output [B, T, channels]."""
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q, k = q.unflatten(-1, (self.num_k_heads, self.k_dim)), k.unflatten(-1, (self.num_k_heads, self.k_dim))
        if self.tiled_v_heads:   # each value head's key head, in the tiled order
            group = self.num_v_heads // self.num_k_heads
            q, k = torch.cat([q] * group, dim=-2), torch.cat([k] * group, dim=-2)
        return q, k, v.unflatten(-1, (self.num_v_heads, self.v_dim))


class SharedExpertMoe(SparseMoeBlock):
    """The routed experts (lmport.models.moe.SparseMoeBlock) plus the shared expert, weighed by its gate."""

    def __init__(self, cfg, backend: Backend, tp: TPGroup, renormalize: bool | None = None):
        super().__init__(cfg, backend)
        if renormalize is not None:   # a family whose router always renormalizes has no norm_topk_prob
            self.renormalize = renormalize
        self.shared_expert = MLP(cfg, backend, tp, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.forward(x)
        return super().forward(x) + shared


class Qwen3NextDecoderLayer(nn.Module):
    linear_attention: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, cfg, backend: Backend, tp: TPGroup, index: int):
        super().__init__()
        self.kind = layer_types(cfg)[index]
        if self.kind == LINEAR:
            self.linear_attn = self.linear_attention(cfg, backend)
        else:
            self.self_attn = GatedAttention(cfg, backend)
        self.mlp = self.make_mlp(cfg, backend, tp, index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, offset=1.0)

    def make_mlp(self, cfg, backend: Backend, tp: TPGroup, index: int) -> nn.Module:
        return SharedExpertMoe(cfg, backend, tp) if is_sparse_layer(cfg, index) else MLP(cfg, backend, tp)


class Qwen3NextCausalLM(PagedCausalLM):
    model_types = QWEN3_NEXT_MODEL_TYPES
    norm_offset = 1.0
    decoder_layer: type[Qwen3NextDecoderLayer] = Qwen3NextDecoderLayer
    layer_class = nn.Identity   # a placeholder per layer: __init__ builds each decoder_layer by its index

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        refuse_tp(cfg, tp)
        super().__init__(cfg, backend, rotary, tp)
        self.model.layers = nn.ModuleList(self.decoder_layer(cfg, backend, self.tp, i)
                                          for i in range(cfg.num_hidden_layers))
        self.states: StateTensors | None = None   # the recurrent-state pool's tensors (bind_states)
        self.state_slots: list[int] | None = None  # each sequence's slot this step, set by the runner

    @classmethod
    def attention_variants(cls, cfg) -> set[str]:
        return {RECURRENT_STATE}

    @classmethod
    def cache_kinds(cls, cfg, tp_size: int = 1) -> tuple[CacheKind, ...]:
        """Paged K/V for the full-attention layers only; the linear layers keep recurrent state (state_pool)."""
        kind = CacheKind("kv", kv_heads_per_rank(cfg, tp_size), head_dim_of(cfg))
        return (kind,) * layer_types(cfg).count(FULL)

    @classmethod
    def recurrent_state(cls, cfg, dtype: torch.dtype) -> RecurrentStateSpec:
        return recurrent_state_spec(cfg, dtype)

    def bind_states(self, states: StateTensors) -> None:
        self.states = states

    def decoder_runner(self) -> ops.DecoderRunner | None:
        return None   # the linear layers are not decoder specs

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: ops.AttentionMetadata, caches: list[LayerCache]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_rows(None, x, meta)
        paged, linear = iter(caches), 0
        for layer in self.model.layers:
            h = layer.input_layernorm.forward(x)
            if layer.kind == LINEAR:
                conv = self.states.conv[linear] if self.states is not None else None
                state = self.states.state[linear] if self.states is not None else None
                h = layer.linear_attn.forward(h, meta, self.state_slots, conv, state)
                linear += 1
            else:
                h = layer.self_attn.forward(h, cos, sin, next(paged), meta)
            x = x + h
            x = x + layer.mlp.forward(layer.post_attention_layernorm.forward(x))
        return self.model.norm.forward(x)
