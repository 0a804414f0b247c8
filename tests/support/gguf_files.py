"""GGUF files written the way llama.cpp's ``convert_hf_to_gguf.py`` (then ``llama-quantize``) writes them.

``write_gguf(path, hf_config, state_dict, tensor_types)`` takes a transformers config and state dict of
one of the architectures lmport runs and writes what a user downloading a GGUF of that model gets:

- the architecture's metadata keys, as the converter's ``set_gguf_parameters`` writes them
  (conversion/base.py ``TextModel``, llama.py, qwen.py, gemma.py, phi.py in llama.cpp's source);
- tensor names from gguf-py's own ``TensorNameMap``;
- the converter's per-architecture changes: Llama / Mistral / Mixtral q and k rows permuted for
  llama.cpp's rotary (``LlamaModel.permute``); Gemma's norm weights stored as ``1 + w``; Phi-3's fused
  ``qkv_proj`` and ``gate_up_proj`` kept fused (``attn_qkv``, ``ffn_up``); experts stacked into
  ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` [experts, out, in] (transformers' fused
  ``gate_up_proj`` split back into gate and up, as the converter does);
- the default model's tokenizer (its ``tokenizer.*`` fields copied; a byte-level BPE vocabulary of
  49,152 tokens, which transformers' GGUF tokenizer builder accepts for every architecture here);
- tensors quantized per ``tensor_types``: a preset named as llama-quantize's (``"Q4_K_M"``, ``"Q5_K_M"``,
  ``"Q6_K"``, ``"Q8_0"``), ``"EVERY"`` (the quantized types in turn over the layers' weights, for
  coverage; the embedding and output as Q4_K_M has them) or a dict from GGUF
  tensor name to type. Norms, biases and the MoE router stay float32, as llama-quantize leaves them.

Mistral and Mixtral are architecture ``llama`` in GGUF (the converter registers MistralForCausalLM
and MixtralForCausalLM under LlamaModel): transformers loads a Mistral file as a Llama (the same model
without a sliding window) and does not map a Mixtral file's experts.
"""
from __future__ import annotations

import functools
import struct
from pathlib import Path

import gguf
import numpy as np
import torch

from support import ggml_quantize
from support.saved_dirs import own_tmp

# transformers model_type -> GGUF architecture (llama.cpp's MODEL_ARCH_NAMES)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}

# llama.cpp's LLAMA_FTYPE_* for general.file_type
FILE_TYPES = {"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q5_K_M": gguf.LlamaFileType.MOSTLY_Q5_K_M,
              "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "EVERY": gguf.LlamaFileType.GUESSED, "F32": gguf.LlamaFileType.ALL_F32}


@functools.cache
def default_model_tokenizer_fields() -> tuple[tuple[str, object, gguf.GGUFValueType, object], ...]:
    """The default model's ``tokenizer.*`` fields as (key, value, type, array element type)."""
    from lmport.models.loader import resolve_model_path
    reader = gguf.GGUFReader(resolve_model_path("smollm2"))
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), vtype, sub))
    return tuple(fields)


# -- metadata ------------------------------------------------------------------------------------

def _rope_theta(cfg, layer_type: str = "full_attention") -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get(layer_type, rope) if isinstance(rope.get(layer_type), dict) else rope
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _write_metadata(w: gguf.GGUFWriter, cfg, file_type) -> None:
    mt = cfg.model_type
    w.add_type(gguf.GGUFType.MODEL)
    # One name for every file: llama.cpp keys per-token attributes on it (a name with "phi3" in it must have
    # Phi-3's own SentencePiece tokens, which the copied vocabulary has not), and transformers on "mistral".
    w.add_name("tiny-random")
    if mt == "gemma2":                                # Gemma2Model.set_gguf_parameters (not TextModel's)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    elif mt == "phi3":                                # Phi3MiniModel.set_gguf_parameters
        rope = cfg.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError("Phi-3 rope scaling: the converter writes rope_factors_* tensors, "
                                      "which transformers' GGUF loader does not read")
        w.add_context_length(cfg.max_position_embeddings)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
                                   // cfg.num_attention_heads)
        w.add_rope_freq_base(_rope_theta(cfg))
        w.add_sliding_window(cfg.sliding_window or 0)
    else:                                             # TextModel.set_gguf_parameters, then the subclass's
        w.add_block_count(cfg.num_hidden_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        rope = cfg.rope_parameters or {}
        if rope.get("full_attention", rope).get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope scaling {rope} is not written here")
        w.add_rope_freq_base(_rope_theta(cfg))
        if mt == "gemma3_text":
            w.add_rope_freq_base_swa(_rope_theta(cfg, "sliding_attention"))
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        if (experts := getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)):
            w.add_expert_count(experts)
            w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "head_dim", None) is not None:   # config.json has head_dim (not Mixtral's: null)
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
        if GGUF_ARCH[mt] == "llama":                  # LlamaModel.set_gguf_parameters
            w.add_vocab_size(cfg.vocab_size)
            w.add_rope_dimension_count(_head_dim(cfg))
        if mt == "qwen3_moe":                         # Qwen2MoeModel.set_gguf_parameters
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if mt == "gemma3_text":                       # Gemma3Model.set_gguf_parameters
            if cfg.final_logit_softcapping:
                w.add_final_logit_softcapping(cfg.final_logit_softcapping)
            w.add_sliding_window(cfg.sliding_window)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in default_model_tokenizer_fields():
        w.add_key_value(key, value, vtype, sub_type=sub)


# -- tensors -------------------------------------------------------------------------------------

def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rows from [first half, second half] of the rotary pairs
    to interleaved (rows 2i, 2i+1 = rows i, i + d/2); n_head is the k heads for k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(cfg, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (transformers' names and layout) -> {GGUF tensor name: float32 tensor} as the converter
    yields them (torch order: the last axis is a row, GGUF's ne[0])."""
    mt = cfg.model_type
    arch = gguf.MODEL_ARCH[GGUF_ARCH[mt].upper()]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    tied = getattr(cfg, "tie_word_embeddings", False)
    out: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        value = value.detach().to(torch.float32)
        if tied and name == "lm_head.weight":
            continue                                   # the converter writes no output tensor when tied
        if mt in ("gemma2", "gemma3_text") and name.endswith("norm.weight"):
            value = value + 1                          # Gemma2Model / Gemma3Model: RMSNorm's (1 + w)
        if GGUF_ARCH[mt] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            value = permute_qk(value, heads)
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * ff, hidden] -> gate, up
            ff = value.shape[1] // 2
            base = name.removesuffix(".gate_up_proj")
            out[names.get_name(base + ".gate_proj") + ".weight"] = value[:, :ff]
            out[names.get_name(base + ".up_proj") + ".weight"] = value[:, ff:]
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[names.get_name(name) + ".weight"] = value
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"{name}: no GGUF name for {mt}")
        out[gguf_name] = value
    return out


# -- per-tensor types (llama-quantize's mixes) ----------------------------------------------------

def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "q2_k": "q4_0", "q3_k": "q4_0"}


def _fits(name: str, shape) -> str:
    """llama-quantize's tensor_type_fallback: a 256-weight type on rows that are not a multiple of 256."""
    if name in _FALLBACK and shape[-1] % 256:
        return _FALLBACK[name]
    return name


def stays_float(name: str, shape) -> bool:
    """Tensors llama-quantize does not quantize: 1-d ones (norms, biases) and the MoE router."""
    return len(shape) < 2 or "ffn_gate_inp" in name or name.endswith("norm.weight")


def tensor_types_for(preset: str, tensors: dict[str, tuple[int, ...]], n_layer: int, n_expert: int = 0,
                     ) -> dict[str, str]:
    """{GGUF name: type name} for a llama-quantize preset (llama_tensor_get_type_impl, for the tensors
    these models have) or "EVERY" (the quantized types in turn over the weights, each where it fits)."""
    types: dict[str, str] = {}
    tied = "output.weight" not in tensors
    cycle = [t for t in ggml_quantize.TYPES]
    for index, (name, shape) in enumerate(tensors.items()):
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if stays_float(name, shape):
            types[name] = "f32"
            continue
        if preset == "EVERY" and name not in ("token_embd.weight", "output.weight"):
            t = cycle[index % len(cycle)]
            types[name] = t if shape[-1] % ggml_quantize.block_elements(t) == 0 else _fits(t, shape)
            continue
        if preset == "F32":
            types[name] = "f32"
            continue
        default = {"Q4_K_M": "q4_k", "Q5_K_M": "q5_k", "Q6_K": "q6_k", "Q8_0": "q8_0", "EVERY": "q4_k"}[preset]
        t = default
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            t = "q8_0" if shape[-1] % 256 or default == "q8_0" else "q6_k"
        elif name.endswith(("attn_v.weight", "attn_qkv.weight")):
            if preset in ("Q4_K_M", "Q5_K_M") and _use_more_bits(layer, n_layer):
                t = "q6_k"
            if n_expert == 8:
                t = "q8_0"
        elif name.endswith("attn_k.weight") and n_expert == 8:
            t = "q8_0"
        elif "ffn_down" in name:
            if preset in ("Q4_K_M", "Q5_K_M") and _use_more_bits(layer, n_layer):
                t = "q6_k"
        elif name.endswith("attn_output.weight") and n_expert == 8 and preset == "Q4_K_M":
            t = "q5_k"
        types[name] = _fits(t, shape)
    return types


# -- the file -------------------------------------------------------------------------------------

def write_gguf(path: str | Path, hf_config, state_dict: dict[str, torch.Tensor],
               tensor_types: str | dict[str, str] = "Q4_K_M") -> dict[str, str]:
    """Write ``path``; returns {GGUF tensor name: type name} as written."""
    cfg = hf_config
    if cfg.model_type not in GGUF_ARCH:
        raise ValueError(f"no GGUF writer for {cfg.model_type!r} (have: {', '.join(GGUF_ARCH)})")
    tensors = gguf_tensors(cfg, state_dict)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    n_expert = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    if isinstance(tensor_types, str):
        file_type = FILE_TYPES[tensor_types]
        types = tensor_types_for(tensor_types, shapes, cfg.num_hidden_layers, n_expert)
    else:
        file_type = gguf.LlamaFileType.GUESSED
        types = {name: tensor_types.get(name, "f32" if stays_float(name, shape) else "q8_0")
                 for name, shape in shapes.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = own_tmp(path)
    w = gguf.GGUFWriter(tmp, GGUF_ARCH[cfg.model_type])
    _write_metadata(w, cfg, file_type)
    for name, value in tensors.items():
        t = types[name]
        data = ggml_quantize.quantize(value.numpy(), t)
        w.add_tensor(name, data, raw_dtype=ggml_quantize.ggml_type(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return types


def reader(path: str | Path) -> gguf.GGUFReader:
    """A GGUFReader of ``path``, one per file version (parsing a 49,152-token vocabulary takes seconds)."""
    path = Path(path).resolve()
    return _reader(path, path.stat().st_mtime_ns)


@functools.cache
def _reader(path: Path, mtime_ns: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def tensor_bytes(path: str | Path) -> int:
    """Bytes of a GGUF's tensor data (what llama.cpp maps), from its header."""
    return sum(int(t.n_bytes) for t in reader(path).tensors)


def dequantized_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF as float32 in torch order, through gguf-py's reference dequantizer."""
    out = {}
    for t in reader(path).tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    return out


def hf_state_dict_from_gguf(cfg, path: str | Path) -> dict[str, torch.Tensor]:
    """The transformers state dict of ``cfg``'s model holding a GGUF's dequantized values: the writer's
    changes undone (rows unpermuted, Gemma's norms less 1, experts restacked). The reference model for
    files transformers cannot load itself (Mixtral: architecture "llama" with experts)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        names = list(AutoModelForCausalLM.from_config(cfg).state_dict())
    deq = {name: torch.from_numpy(np.array(v)) for name, v in dequantized_tensors(path).items()}
    mt = cfg.model_type
    gmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[mt].upper()], cfg.num_hidden_layers)
    out = {}
    for name in names:
        if name == "lm_head.weight" and "output.weight" not in deq:
            out[name] = deq["token_embd.weight"]
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            out[name] = torch.cat([deq[gmap.get_name(base + ".gate_proj") + ".weight"],
                                   deq[gmap.get_name(base + ".up_proj") + ".weight"]], dim=1)
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[name] = deq[gmap.get_name(name) + ".weight"]
            continue
        value = deq[gmap.get_name(name, try_suffixes=(".weight", ".bias"))]
        if GGUF_ARCH[mt] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            value = unpermute_qk(value, heads)
        if mt in ("gemma2", "gemma3_text") and name.endswith("norm.weight"):
            value = value - 1
        out[name] = value
    return out


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of :func:`permute_qk` (transformers' reverse permutation)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def with_value(source: Path, key: str, value: int, out: Path) -> Path:
    """A copy of the GGUF file ``source`` at ``out`` whose integer metadata value of ``key`` is ``value``."""
    data = bytearray(source.read_bytes())
    raw = key.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
    (kind,) = struct.unpack_from("<I", data, at)
    struct.pack_into({4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[kind], data, at + 4, value)
    out.write_bytes(data)
    return out
