"""Paged-attention decoder for the Llama family (Llama, SmolLM2, SmolLM3, Mistral), Qwen2 and Qwen3, and the
``PagedCausalLM`` every architecture subclasses (Gemma, Phi-3, the MoE models), which takes what differs
between them as class attributes and hooks: the decoder layer, the norms' offset, the embedding scale,
each layer's rope kind and window, the attention and final soft caps.

Parameter names match transformers' so its state dict loads as is. Every
device-specific op (linear, RMSNorm, rotary, the gated activation, KV fill,
paged attention) goes through the backend (lmport.models.layers); the rest is plain torch.

In the per-layer loop, submodules are called through ``.forward``: lmport registers no hooks,
so ``nn.Module.__call__``'s hook dispatch (a few calls a layer) would be pure overhead.
"""
from __future__ import annotations

import torch
from torch import nn

from lmport import ops
from lmport.platform.backend import Backend
from lmport.kv.layout import CacheKind, LayerCache
from lmport.models.activations import activation
from lmport.models.dims import head_dim_of
from lmport.models.layers import (ColumnParallelLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding,
                                  apply_rope, linear_weights, norm_spec)
from lmport.models.rope_table import RopeTable
from lmport.models.windows import layer_windows
from lmport.parallel import TPGroup, balanced, kv_heads_per_rank, split
from lmport.units import ceil_div

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
# The rope kind of a layer that takes no rotary embedding (SmolLM3's and Llama 4's NoPE layers): its cos/sin are
# ones and zeros, which leave q and k exactly as they are, so such a layer runs the same code (and decoder runner).
NO_ROPE = "no_rope"


def no_rope_layers(cfg) -> list[bool]:
    """Per layer, whether it skips rotary: transformers' ``no_rope_layers`` holds 1 where a layer uses rope."""
    flags = getattr(cfg, "no_rope_layers", None)
    if not flags:
        return [False] * cfg.num_hidden_layers
    if len(flags) < cfg.num_hidden_layers:
        raise ValueError(f"config.no_rope_layers has {len(flags)} entries for {cfg.num_hidden_layers} layers")
    return [not bool(f) for f in flags[:cfg.num_hidden_layers]]


class Attention(nn.Module):
    """This rank's attention heads (all of them at tp=1) and their KV heads."""

    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.backend = backend
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(cfg, tp.size)
        self.head_dim = d = head_dim_of(cfg)
        self.scale = self.head_dim ** -0.5
        qkv_bias = cfg.model_type == "qwen2" or getattr(cfg, "attention_bias", False)
        q0, q1 = tp.head_range(cfg.num_attention_heads)
        k0, k1 = tp.kv_head_range(cfg.num_key_value_heads)
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, (q0 * d, q1 * d), qkv_bias, backend)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, (k0 * d, k1 * d), qkv_bias, backend)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, (k0 * d, k1 * d), qkv_bias, backend)
        # Qwen2 and GLM-4.5 put a bias on q, k and v only (their o_proj has none).
        o_bias = getattr(cfg, "attention_bias", False) and cfg.model_type not in ("qwen2", "glm4_moe")
        self.o_proj = RowParallelLinear((q0 * d, q1 * d), cfg.hidden_size, o_bias, backend, tp)
        # q, k and v as one linear once loaded (models/fusion.py), split back into these numbers of heads.
        self.qkv_proj: nn.Module | None = None
        self.qkv_heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        # Qwen3 (and GLM-4.5 where use_qk_norm) normalizes each head of q and k before rotary.
        self.qk_norm = cfg.model_type in ("qwen3", "qwen3_moe") or (cfg.model_type == "glm4_moe" and cfg.use_qk_norm)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of ``x``, each (tokens, heads, head_dim)."""
        # unflatten, not view: a backend's linear need not return a contiguous result.
        if self.qkv_proj is None:
            q, k, v = (p.forward(x).unflatten(-1, (-1, self.head_dim)) for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = self.qkv_proj.forward(x).unflatten(-1, (-1, self.head_dim)).split(self.qkv_heads, dim=1)
        return q, k, v

    def layer_meta(self, meta: ops.AttentionMetadata) -> ops.AttentionMetadata:
        """What this layer's attention reads of the step's metadata (a subclass adds its sinks, window, chunk)."""
        return meta

    def forward(self, x, cos, sin, cache: LayerCache, meta: ops.AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = apply_rope(self.backend, q, k, cos, sin)
        self.backend.fill_kv_cache(k, v, cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, cache, self.layer_meta(meta), self.scale, new_kv=(k, v))
        return self.o_proj.forward(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    """The gated MLP; ``intermediate_size``: another width than the config's (an MoE model's shared experts)."""

    def __init__(self, cfg, backend: Backend, tp: TPGroup, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        part = balanced(intermediate_size or cfg.intermediate_size, tp.size, tp.rank)
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, part, bias, backend)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, part, bias, backend)
        self.down_proj = RowParallelLinear(part, cfg.hidden_size, bias, backend, tp)
        self.gate_up_proj: nn.Module | None = None   # gate and up as one linear once loaded (models/fusion.py)
        self.backend = backend
        self.act_name = getattr(cfg, "hidden_activation", None) or cfg.hidden_act   # Gemma: hidden_activation
        self.act = None if self.act_name == "silu" else activation(self.act_name)

    def forward(self, x):
        return self.down_proj.forward(self.activated(x))

    def activated(self, x):
        """act(gate(x)) * up(x): what down_proj takes (this rank's columns under tensor parallelism)."""
        if self.gate_up_proj is None:
            gate, up = self.gate_proj.forward(x), self.up_proj.forward(x)
        else:
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        if self.act is None:
            return self.backend.silu_and_mul(gate, up)
        return self.act(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = Attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = MLP(cfg, backend, tp)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))

    def spec(self) -> ops.DecoderLayerSpec | None:
        """This layer as data for a backend's decoder runner (lmport.ops.decoder), or None where the
        spec does not describe it (layer_spec)."""
        if type(self).forward is not DecoderLayer.forward:
            return None
        return layer_spec(self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)


# The MLP activations a decoder spec runs: config name -> the spec's name.
SPEC_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def layer_spec(attention_norm: RMSNorm, attn: nn.Module, mlp_norm: RMSNorm, mlp: nn.Module,
               attention_output_norm: RMSNorm | None = None,
               mlp_output_norm: RMSNorm | None = None) -> ops.DecoderLayerSpec | None:
    """A layer of these modules as lmport.ops.decoder describes it, or None where they are not what the
    spec describes: an attention or MLP computed otherwise (a subclass's forward, an MoE block), an
    activation the spec lacks, projections left unmerged, a linear of another kind (tensor-parallel, LoRA)."""
    if not (isinstance(attn, Attention) and type(attn).forward is Attention.forward and type(mlp) is MLP):
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    qkv, o, gate_up, down = (linear_weights(m) for m in linears)
    act = SPEC_ACTIVATIONS.get(mlp.act_name)
    if qkv is None or o is None or gate_up is None or down is None or act is None:
        return None
    return ops.DecoderLayerSpec(
        attention_norm=norm_spec(attention_norm), qkv=qkv, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, scale=attn.scale, o=o, mlp_norm=norm_spec(mlp_norm), gate_up=gate_up, down=down,
        activation=act, q_norm=norm_spec(attn.q_norm) if attn.qk_norm else None,
        k_norm=norm_spec(attn.k_norm) if attn.qk_norm else None,
        attention_output_norm=None if attention_output_norm is None else norm_spec(attention_output_norm),
        mlp_output_norm=None if mlp_output_norm is None else norm_spec(mlp_output_norm))


class Decoder(nn.Module):
    def __init__(self, cfg, backend: Backend, tp: TPGroup, layer_class: type[nn.Module], norm_offset: float):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(layer_class(cfg, backend, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, norm_offset)


class PagedCausalLM(nn.Module):
    """``forward`` runs one step's new tokens (flattened over sequences) and returns hidden states.

    Under tensor parallelism (``tp``) the module holds one rank's shard (lmport.parallel). A subclass
    for another architecture sets the class attributes and overrides the hooks below; everything else
    (the rope tables, the per-layer windows and soft caps, the backend's decoder runner) is shared."""

    model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES
    layer_class: type[nn.Module] = DecoderLayer   # built (cfg, backend, tp) once per layer
    norm_offset = 0.0                             # the final norm's (lmport.models.layers.RMSNorm)

    def __init__(self, cfg, backend: Backend, rotary: nn.Module, tp: TPGroup | None = None):
        super().__init__()
        if cfg.model_type not in self.model_types:   # model_class() (models/architectures.py) picks the class
            raise ValueError(f"model type {cfg.model_type!r} is not one {type(self).__name__} runs; it runs "
                             f"{', '.join(self.model_types)}")
        self.config = cfg
        self.tp = tp = tp or TPGroup()
        self.model = Decoder(cfg, backend, tp, self.layer_class, self.norm_offset)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, split(cfg.vocab_size, tp.size, tp.rank), False, backend)
        self.rotary = rotary  # transformers' own rotary module: every rope variant it knows
        self.rope_kinds = self.layer_rope_kinds(cfg)   # each layer's argument to the rotary module (None: none)
        # cos/sin by position for each kind, filled once where they can be
        self.rope_tables = {kind: RopeTable(kind) for kind in dict.fromkeys(self.rope_kinds)}
        self.windows = layer_windows(cfg)   # each layer's sliding window (None: full attention)
        self.embed_scale = self.embedding_scale(cfg)
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.backend = backend
        self._runner: tuple[ops.DecoderRunner | None] | None = None   # decoder_runner(), once built

    @classmethod
    def attention_variants(cls, cfg) -> set[str]:
        """The attention variants (lmport.platform.backend.ATTENTION_VARIANTS) this model's layers need of a backend's
        paged_attention; checked against its Capabilities before any weight loads (lmport.platform.resolution)."""
        return set()

    @classmethod
    def cache_kinds(cls, cfg, tp_size: int = 1) -> tuple[CacheKind, ...]:
        """What each layer caches a token (lmport.kv.layout.CacheKind), on one of ``tp_size`` ranks: the KV
        layout, the memory plan and the capacity figures are sized from it. Default: paged K and V of this
        rank's KV heads."""
        return (CacheKind("kv", kv_heads_per_rank(cfg, tp_size), head_dim_of(cfg)),) * cfg.num_hidden_layers

    def embedding_scale(self, cfg) -> float | None:
        """What the embeddings are multiplied by (in their dtype) before the first layer; None: nothing."""
        return None

    def layer_rope_kinds(self, cfg) -> list[str | None]:
        """Per layer, the extra argument its rotary module call takes (Gemma 3's layer type: each kind has
        its own rope base); None: the layer takes the model's one rope; NO_ROPE: none (``no_rope_layers``)."""
        return [NO_ROPE if skip else None for skip in no_rope_layers(cfg)]

    def rope_rows(self, kind: str | None, x: torch.Tensor, meta: ops.AttentionMetadata):
        """cos and sin [tokens, rotary dim] of the step's positions for layers of ``kind``."""
        if kind == NO_ROPE:
            d = head_dim_of(self.config)
            return x.new_ones(meta.num_tokens, d), x.new_zeros(meta.num_tokens, d)
        return self.rope_tables[kind](self.rotary, x, meta.positions, meta.max_kv_len)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: ops.AttentionMetadata, caches: list[LayerCache]) -> torch.Tensor:
        x = self.embed(input_ids)
        ropes = {kind: self.rope_rows(kind, x, meta) for kind in self.rope_tables}
        metas = {w: meta.for_layer(w, self.attn_softcap) for w in set(self.windows)}
        runner = self.decoder_runner()
        out = None if runner is None else runner(x, [ropes[kind] for kind in self.rope_kinds], caches,
                                                  [metas[w] for w in self.windows])
        if out is None:
            for layer, cache, window, kind in zip(self.model.layers, caches, self.windows, self.rope_kinds,
                                                  strict=True):
                x = layer.forward(x, *ropes[kind], cache, metas[window])
            out = x
        return self.model.norm.forward(out)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings (a vision-language model places its images' rows among them)."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def decoder_runner(self) -> ops.DecoderRunner | None:
        """The backend's runner over all the layers (Backend.decoder_runner), built at the first step,
        once the weights are loaded and merged, and again after ``.to()``; None where the backend has
        none or a layer has no spec (lmport.ops.decoder), and under tensor parallelism."""
        if self._runner is None:
            specs = [spec() if callable(spec := getattr(layer, "spec", None)) else None for layer in self.model.layers]
            complete = [s for s in specs if s is not None]
            usable = self.tp.size == 1 and len(complete) == len(specs)
            self._runner = (self.backend.decoder_runner(complete) if usable else None,)
        return self._runner[0]

    def _apply(self, fn, recurse=True):
        self._runner = None   # .to() and the like replace the tensors a runner holds
        return super()._apply(fn, recurse)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the whole vocabulary on rank 0 (None on the other ranks)."""
        local = self.lm_head(hidden).float().contiguous()  # sampling wants rows; linear need not give them
        vocab = self.config.vocab_size
        logits = self.tp.gather_columns(local, ceil_div(vocab, self.tp.size), vocab)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slices of a full checkpoint's state dict (views at tp=1, copies otherwise, so the
        full tensors can be freed); a row-parallel bias stays whole (it is added once, after the sum)."""
        if self.tp.size == 1:
            return full
        out, copies = dict(full), {}
        for name, module in self.named_modules():
            if not hasattr(module, "shard_dim"):
                continue
            start, end = module.shard_range  # pyright: ignore[reportGeneralTypeIssues] (a parallel linear's)
            for pname in ("weight", "bias"):
                key = f"{name}.{pname}"
                if key not in full or (pname == "bias" and module.shard_dim == 1):
                    continue
                src, dim = full[key], module.shard_dim if pname == "weight" else 0
                slot = (src.data_ptr(), dim, start, end)    # tied weights stay one tensor
                if slot not in copies:
                    copies[slot] = src.narrow(dim, start, end - start).clone()
                out[key] = copies[slot]
        return out
