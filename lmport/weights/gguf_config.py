"""The config of a Llama GGUF (the default model's architecture) without importing transformers' Llama config
module.

In transformers 5.23 every ``configuration_<model>.py`` imports ``transformers.utils.type_validators``,
which imports ``transformers.activations`` to check ``hidden_act`` against ``ACT2FN``; that imports its
hub-kernel registry, which pulls in ``torch._dynamo`` and ``torch.distributed.tensor``: 1.5-3 s and about
155 MiB of RSS on a 2-core machine, the largest part of a cold load of the default model. Nothing else a
GGUF load does needs that module.

``GGUFLlamaConfig`` is transformers' ``LlamaConfig`` as a plain subclass of ``PreTrainedConfig`` (which
imports none of it): the same fields, defaults and ``__post_init__`` (rope parameters standardized by the
base class), ``model_type = "llama"``, so ``to_dict()`` / ``save_pretrained`` write what LlamaConfig writes.
What it leaves out is the type validation LlamaConfig's ``@strict`` adds. ``tests/test_gguf_config.py`` checks
its fields and defaults against LlamaConfig's and the configs made of the test GGUFs and the default model
against transformers' own. Where a transformers model must be built from it (a rotary module lmport does not
implement), ``as_transformers_config`` gives transformers' class.
"""
from __future__ import annotations

import numpy as np
from transformers.configuration_utils import PreTrainedConfig


class GGUFLlamaConfig(PreTrainedConfig):
    """transformers' ``LlamaConfig`` (fields, defaults, post-init), for a GGUF of architecture ``llama``."""

    model_type = "llama"
    keys_to_ignore_at_inference = ["past_key_values"]   # noqa: RUF012 -- as LlamaConfig declares it

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    head_dim: int | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"The hidden size ({self.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({self.num_attention_heads}).")


def as_transformers_config(cfg):
    """``cfg`` as transformers' own config class (a ``GGUFLlamaConfig`` becomes a ``LlamaConfig``: this imports
    ``transformers.activations``); any other config as it is."""
    if not isinstance(cfg, GGUFLlamaConfig):
        return cfg
    from transformers import LlamaConfig
    return LlamaConfig(**cfg.to_dict())


# Metadata keys (under the architecture's prefix) -> config fields, for the architectures transformers' GGUF
# loader has no table of (transformers.integrations.ggml.GGUF_CONFIG_MAPPING); the keys are the ones
# llama.cpp's convert_hf_to_gguf.py writes for them.
_COMMON_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"}
_QWEN3_NEXT_KEYS = _COMMON_KEYS | {
    "attention.key_length": "head_dim", "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "ssm.conv_kernel": "linear_conv_kernel_dim", "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads", "ssm.time_step_rank": "linear_num_value_heads"}
EXTRA_CONFIG_MAPPING = {
    # SmolLM3: its rotary-less layers are every 4th, which llama.cpp does not store but assumes (as the config's
    # default no_rope_layer_interval does)
    "smollm3": _COMMON_KEYS,
    "glm4_moe": _COMMON_KEYS | {
        "attention.key_length": "head_dim", "expert_count": "n_routed_experts",
        "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_count": "n_shared_experts", "leading_dense_block_count": "first_k_dense_replace",
        "expert_group_count": "n_group", "expert_group_used_count": "topk_group",
        "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
        "nextn_predict_layers": "num_nextn_predict_layers"},
    # DeepSeek-V3 (llama.cpp's deepseek2): head_count_kv is the latent's one "head" (llama.cpp runs MLA as MQA),
    # not the config's; the key and value head sizes are the *_mla keys (architecture_fields)
    "deepseek_v3": {k: v for k, v in _COMMON_KEYS.items() if k != "attention.head_count_kv"} | {
        "attention.kv_lora_rank": "kv_lora_rank", "attention.value_length_mla": "v_head_dim",
        "rope.dimension_count": "qk_rope_head_dim", "expert_count": "n_routed_experts",
        "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_count": "n_shared_experts", "leading_dense_block_count": "first_k_dense_replace",
        "expert_group_count": "n_group", "expert_group_used_count": "topk_group",
        "expert_weights_scale": "routed_scaling_factor"},
    # Qwen3-Next: llama.cpp's ssm keys name the linear-attention layers' sizes (its conv kernel, key head size,
    # key heads and value heads); the value head size is ssm.inner_size over the value heads (architecture_fields)
    "qwen3_next": _QWEN3_NEXT_KEYS,
    # Qwen3.5 (llama.cpp's qwen35 and qwen35moe): Qwen3-Next's keys
    "qwen3_5_text": _QWEN3_NEXT_KEYS, "qwen3_5_moe_text": _QWEN3_NEXT_KEYS,
    # Llama 4: the dense layers' width is feed_forward_length (the config's intermediate_size_mlp), the experts'
    # expert_feed_forward_length
    "llama4_text": _COMMON_KEYS | {
        "feed_forward_length": "intermediate_size_mlp", "attention.key_length": "head_dim",
        "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "intermediate_size", "interleave_moe_layer_step": "interleave_moe_layer_step"},
    # gpt-oss: llama.cpp's key for the window (transformers' table reads "sliding_window", which the converter
    # does not write); the experts' width is expert_feed_forward_length (the config's intermediate_size)
    "gpt_oss": _COMMON_KEYS | {
        "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
        "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "intermediate_size"},
}
_SIGMOID_GATING = 2   # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def architecture_fields(arch: str, model_type: str, meta: dict, tensor_names: set[str]) -> dict:
    """The config fields of ``model_type`` that a GGUF of ``arch`` gives by its tensors or by keys whose meaning
    differs from the config's: biases and q/k norms present, GLM's rotary width as a fraction of the head and
    its layer count without the multi-token-prediction layers (which the converter counts in block_count)."""
    fields = {}
    if model_type == "deepseek_v3":
        return _deepseek_v3_fields(arch, meta)
    if model_type == "qwen3_next":
        return _qwen3_next_fields(arch, meta, tensor_names)
    if model_type == "gpt_oss":
        return _gpt_oss_fields(arch, meta, tensor_names)
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        return _qwen3_5_fields(arch, meta, tensor_names)
    if model_type == "llama4_text":
        return _llama4_fields(arch, meta)
    if model_type == "qwen3_moe" and f"{arch}.expert_feed_forward_length" in meta:
        # transformers' qwen3moe table lacks the experts' width (its default, 768, is Qwen3-30B-A3B's alone)
        fields["moe_intermediate_size"] = meta[f"{arch}.expert_feed_forward_length"]
    if model_type in ("smollm3", "glm4_moe"):
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if model_type == "glm4_moe":
        if (gating := meta.get(f"{arch}.expert_gating_func", _SIGMOID_GATING)) != _SIGMOID_GATING:
            from lmport.errors import ConfigError
            raise ConfigError(f"{arch}.expert_gating_func is {gating}: GLM-4.5 routes experts by sigmoid "
                              f"({_SIGMOID_GATING}); the file was not written by llama.cpp's converter")
        head_dim = meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // meta[
            f"{arch}.attention.head_count"]
        fields["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensor_names
        fields["num_hidden_layers"] = meta[f"{arch}.block_count"] - meta.get(f"{arch}.nextn_predict_layers", 0)
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
                                     "partial_rotary_factor": meta.get(f"{arch}.rope.dimension_count", head_dim)
                                     / head_dim}
    return fields


def _deepseek_v3_fields(arch: str, meta: dict) -> dict:
    """DeepSeek-V3's fields that a deepseek2 GGUF gives otherwise than by a key of its own: a key the converter
    writes only when set stands for the config's "unset" value (not transformers' DeepSeek-V3 default), the q/k
    head without rotary is key_length_mla less the rotary part, a yarn rope's mscale is stored as 0.1 x
    mscale_all_dim (llama.cpp takes the two equal, as DeepSeek-V3's config has them), and the rotary always turns
    interleaved pairs (llama.cpp's deepseek2 rope). DeepSeek-V2's softmax routing (a file without the sigmoid
    gating function) is refused."""
    from lmport.errors import ConfigError
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating != _SIGMOID_GATING:
        raise ConfigError(f"{arch}.expert_gating_func is {'missing' if gating is None else gating}: lmport runs "
                          f"DeepSeek-V3's sigmoid routing ({_SIGMOID_GATING}) of deepseek2 files; llama.cpp reads a "
                          f"file without it as DeepSeek-V2's softmax routing, which lmport does not run")
    rope = meta[f"{arch}.rope.dimension_count"]
    theta = meta.get(f"{arch}.rope.freq_base", 10000.0)
    rope_parameters: dict = {"rope_type": "default", "rope_theta": theta}
    if meta.get(f"{arch}.rope.scaling.type") == "yarn":
        # in float32, as llama.cpp divides it back (0.1 x 1.0 stored as float32 gives 1.0 again)
        mscale = float(np.float32(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / np.float32(0.1))
        rope_parameters = {
            "rope_type": "yarn", "rope_theta": theta, "factor": meta[f"{arch}.rope.scaling.factor"],
            "original_max_position_embeddings": meta[f"{arch}.rope.scaling.original_context_length"],
            "beta_fast": meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0), "mscale": mscale,
            "mscale_all_dim": mscale}
    return {"q_lora_rank": meta.get(f"{arch}.attention.q_lora_rank"),
            "qk_nope_head_dim": meta[f"{arch}.attention.key_length_mla"] - rope,
            "num_key_value_heads": meta[f"{arch}.attention.head_count"],
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", False)),
            "routed_scaling_factor": meta.get(f"{arch}.expert_weights_scale", 1.0),
            "n_group": meta.get(f"{arch}.expert_group_count", 1), "topk_group": meta.get(
                f"{arch}.expert_group_used_count", 1),
            "first_k_dense_replace": meta.get(f"{arch}.leading_dense_block_count", 0),
            "n_shared_experts": meta.get(f"{arch}.expert_shared_count", 0),
            "rope_parameters": rope_parameters, "rope_interleave": True, "attention_bias": False}


def _qwen3_next_fields(arch: str, meta: dict, tensor_names: set[str]) -> dict:
    """Qwen3-Next's fields a qwen3next GGUF gives otherwise: which layers are linear (``recurrent_layers``), the
    rotary width as a fraction of the head, and what llama.cpp's qwen3next always does: experts on every layer,
    the top k renormalized. Its linear layers' projections are held as llama.cpp stores them
    (lmport.models.qwen3_next.LLAMA_CPP_PROJECTIONS)."""
    from lmport.models.qwen3_next import LLAMA_CPP_PROJECTIONS
    # the multi-token-prediction layers the converter appends by default are counted in block_count, not loaded
    layers = meta[f"{arch}.block_count"] - meta.get(f"{arch}.nextn_predict_layers", 0)
    recurrent = meta[f"{arch}.attention.recurrent_layers"][:layers]
    head_dim = meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // meta[
        f"{arch}.attention.head_count"]
    return {"num_hidden_layers": layers,
            "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
            "linear_value_head_dim": meta[f"{arch}.ssm.inner_size"] // meta[f"{arch}.ssm.time_step_rank"],
            "rope_parameters": {"rope_type": "default", "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
                                "partial_rotary_factor": meta.get(f"{arch}.rope.dimension_count", head_dim) / head_dim},
            "mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True,
            "attention_bias": any(n.endswith("attn_q.bias") for n in tensor_names),
            "linear_projections": LLAMA_CPP_PROJECTIONS}


def _gpt_oss_fields(arch: str, meta: dict, tensor_names: set[str]) -> dict:
    """gpt-oss's fields a gpt-oss GGUF gives otherwise, or leaves to what llama.cpp assumes of every gpt-oss: the
    yarn rope from the rope.scaling keys, without truncating its correction range (the released config's
    ``"truncate": false``, which the file does not store); sliding and full layers alternating from a sliding
    first (llama.cpp's pattern of 2, the config's default ``layer_types``); biases by the tensors present."""
    rope: dict = {"rope_type": "default", "rope_theta": meta.get(f"{arch}.rope.freq_base", 150000.0)}
    if meta.get(f"{arch}.rope.scaling.type") == "yarn":
        rope |= {"rope_type": "yarn", "factor": meta[f"{arch}.rope.scaling.factor"],
                 "original_max_position_embeddings": meta[f"{arch}.rope.scaling.original_context_length"],
                 "beta_fast": meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
                 "beta_slow": meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0), "truncate": False}
    layers = meta[f"{arch}.block_count"]
    return {"rope_parameters": rope, "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}


def _qwen3_5_fields(arch: str, meta: dict, tensor_names: set[str]) -> dict:
    """Qwen3.5's fields a qwen35 / qwen35moe GGUF gives otherwise: the linear layers and the rotary width as for
    Qwen3-Next, the multimodal rotary's sections (``rope.dimension_sections``, interleaved as Qwen3.5's always is;
    on text the ordinary partial rotary), and the linear layers' value heads in the order the converter stores them
    (``linear_value_heads_tiled``: tiled over the key heads, lmport.models.qwen3_next.GatedDeltaNet)."""
    fields = _qwen3_next_fields(arch, meta, tensor_names)
    for key in ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "linear_projections"):
        fields.pop(key)   # Qwen3.5's layers have no such choice
    sections = list(meta.get(f"{arch}.rope.dimension_sections", []))[:3]
    fields["rope_parameters"] |= {"mrope_section": sections, "mrope_interleaved": True} if any(sections) else {}
    fields["linear_value_heads_tiled"] = True
    return fields


# What llama.cpp's llama4 assumes of every file that does not turn chunking off (src/models/llama4.cpp): chunks of
# 8192 positions on the rope layers, every 4th layer NoPE with the attention temperature's floor 8192 and scale 0.1.
_LLAMA4_CHUNK, _LLAMA4_NOPE_INTERVAL, _LLAMA4_FLOOR_SCALE, _LLAMA4_ATTN_SCALE = 8192, 4, 8192, 0.1
_LLAMA4_MAVERICK_EXPERTS = 128   # llama.cpp's 17B-128E, the one Llama 4 without q/k norms


def _llama4_fields(arch: str, meta: dict) -> dict:
    """Llama 4's fields a llama4 GGUF does not store, as llama.cpp's llama4 sets them: chunked attention with its
    NoPE layers and temperature tuning unless ``attention.sliding_window`` is 0 (MobileLLM's files: rope on every
    layer, full attention), the L2 q/k norm on the rope layers of every model but the 128-expert one."""
    fields: dict = {"attention_bias": False,
                    "use_qk_norm": meta.get(f"{arch}.expert_count") != _LLAMA4_MAVERICK_EXPERTS,
                    "rope_parameters": {"rope_type": "default",
                                        "rope_theta": meta.get(f"{arch}.rope.freq_base", 500000.0)}}
    if meta.get(f"{arch}.attention.sliding_window", None) == 0:
        layers = meta[f"{arch}.block_count"]
        return fields | {"attention_chunk_size": None, "no_rope_layers": [1] * layers,
                         "attn_temperature_tuning": False}
    return fields | {"attention_chunk_size": _LLAMA4_CHUNK, "no_rope_layer_interval": _LLAMA4_NOPE_INTERVAL,
                     "floor_scale": _LLAMA4_FLOOR_SCALE, "attn_scale": _LLAMA4_ATTN_SCALE,
                     "attn_temperature_tuning": True}
