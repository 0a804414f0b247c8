"""GGUF files loaded as they are: tensors read from the memory-mapped file under transformers' names.

- Q4_0, Q4_1 and Q8_0 blocks map bit for bit onto the internal int4 / int8 format
  (lmport.weights.format); the other quantized types lmport runs (lmport.weights.ggml.BLOCK_TYPES:
  the K-quants, Q5_0, Q5_1, IQ4) stay in their blocks, viewed straight from the mapped file.
- Float tensors (norms) load in the compute dtype.
- Names: gguf's own ``TensorNameMap`` for the architecture, asked for each tensor the model has.
- What llama.cpp's ``convert_hf_to_gguf.py`` changed is undone: Llama's q/k rows interleaved for its
  rotary (on whole rows, so quantized rows too), Gemma's norm weights stored as ``1 + w``, experts
  stacked into ``ffn_{gate,up,down}_exps`` (quantized: kept stacked, each one weight of all the experts'
  rows, run by lmport.models.quantized.QuantExperts). Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate, then up)
  are split by rows into the projections the model has.
"""
from __future__ import annotations

import functools
import logging
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import torch

from lmport.config import ConfigError
from lmport.weights import row_range
from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import HELD_BLOCK_TYPES, GGMLWeight
from lmport.weights.gguf_checks import DamagedHeader, check_metadata
from lmport.weights.gguf_header import GGUFHeader, TensorInfo, read_header
from lmport.weights.residency import page_out, read_ahead
from lmport.weights.split import SPLIT_FIX

log = logging.getLogger(__name__)
_LAYER = re.compile(r"blk\.(\d+)\.")

# GGUF architectures lmport runs -> what they hold (llama.cpp writes Mistral and Mixtral as "llama").
SUPPORTED_ARCHITECTURES = {
    "llama": "Llama, Mistral, Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3moe": "Qwen3-MoE",
    "gemma2": "Gemma 2", "phi3": "Phi-3", "smollm3": "SmolLM3",
    "glm4moe": "GLM-4.5", "deepseek2": "DeepSeek-V3", "qwen3next": "Qwen3-Next", "gpt-oss": "gpt-oss",
    "qwen35": "Qwen3.5 (text)", "qwen35moe": "Qwen3.5-MoE (text)",
    "gemma3": "Gemma 3 (text; its images with an mmproj file, lmport.multimodal.mmproj)",
    "llama4": "Llama 4 (text; its images with an mmproj file)",
    "qwen2vl": "Qwen2.5-VL (text; its images with an mmproj file)",
    "qwen3vl": "Qwen3-VL (text; its images with an mmproj file)",
    "mistral3": "Mistral 3 (text; its images with an mmproj file)",
}
# GGUF architecture -> transformers model type, where they differ.
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text", "glm4moe": "glm4_moe", "deepseek2": "deepseek_v3",
                "qwen3next": "qwen3_next", "gpt-oss": "gpt_oss", "qwen35": "qwen3_5_text",
                "qwen35moe": "qwen3_5_moe_text", "llama4": "llama4_text",
                # Qwen2.5-VL's text model: Qwen2's decoder; its multimodal rotary turns text as the plain one does
                "qwen2vl": "qwen2", "qwen3vl": "qwen3", "mistral3": "mistral"}
# Architectures with Qwen3-Next's linear-attention layers, whose tensors the converter changes alike.
_LINEAR_ATTENTION = ("qwen3next", "qwen35", "qwen35moe")
# Qwen3-Next's linear-layer parameters without a weight / bias suffix -> the GGUF tensor they come from, by the
# name gguf's map gives the module (A_log is stored as -exp(A_log), under no suffix; dt_bias as dt_proj's bias).
_LINEAR_PARAMETERS = {"linear_attn.A_log": ("linear_attn.A_log", ""), "linear_attn.dt_bias": ("linear_attn.dt_proj",
                                                                                              ".bias")}
# Architectures whose q/k rows (and biases) llama.cpp's converter interleaves for its rotary.
_PERMUTED_QK = ("llama", "smollm3", "mistral3")
# Tensors a converter may write that the model computes from its config instead.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# A mixture-of-experts block's experts stacked into one tensor each (gate, up, down): under tensor parallelism the
# only tensors a GGUF keeps quantized (lmport.models.moe.shard_quantized_experts splits them).
_STACKED_EXPERTS = re.compile(r"\.ffn_(gate|up|down)_exps\.weight$")
# Phi-3's checkpoint fusions: the fused projection -> its parts, in row order.
_PHI3_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _types():
    from gguf import GGMLQuantizationType as T
    return {T.Q4_0: "int4", T.Q4_1: "int4", T.Q8_0: "int8"}, {T.F32, T.F16, T.BF16}


def read(path: Path) -> GGUFHeader:
    """The file's header (the tensor data memory-mapped, none of it read), parsed once for the checks,
    the config and the tensors. Every GGUF load starts here, so a damaged header
    (lmport.weights.gguf_checks) is refused before anything is built from it."""
    stat = path.stat()
    return _read(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    try:
        header = read_header(path)
        if header.metadata.get("general.architecture") in SUPPORTED_ARCHITECTURES:   # others: architecture()
            check_metadata(header.metadata, header.tensors)
        return header
    except DamagedHeader as exc:
        raise ConfigError(f"{path.name}: {exc}") from None
    except (ValueError, struct.error, OverflowError, OSError) as exc:
        raise ConfigError(f"{path.name} is not a readable GGUF file: {exc}") from None


def architecture(path: Path) -> str:
    """``general.architecture``; ConfigError naming it and the supported list when lmport does not run it."""
    arch = read(path).metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{a} ({what})" for a, what in SUPPORTED_ARCHITECTURES.items())
        raise ConfigError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {supported}")
    return arch


def tensor_formats(path: Path) -> tuple[set[tuple[int, int]], set[str], dict[str, str]]:
    """From the header alone: the (bits, 32) int formats its Q4_0/Q4_1/Q8_0 tensors map onto, the block
    types kept as they are, and {tensor: type} of quantized tensors lmport has no kernel form for."""
    int_types, float_types = _types()
    formats, blocks, other = set(), set(), {}
    for t in read(path).tensors:
        qtype = _qtype(t)
        if qtype in int_types:
            formats.add((int(int_types[qtype][3:]), 32))
        elif qtype.name.lower() in HELD_BLOCK_TYPES:
            blocks.add(qtype.name.lower())
        elif qtype not in float_types:
            other[t.name] = qtype.name
    return formats, blocks, other


def _qtype(t: TensorInfo):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType(t.ggml_type)


def transformers_config(path: Path):
    """The transformers config of a GGUF, from its metadata as transformers' own GGUF loader maps it (its
    key table and defaults), with llama.cpp's renamings undone: Mistral and Mixtral are written as llama
    (Mixtral: with experts), Qwen3-MoE as qwen3moe, Gemma 3's text model as gemma3. A Llama's is
    lmport.weights.gguf_config.GGUFLlamaConfig (transformers' LlamaConfig without importing its module)."""
    model_type, config = config_fields(path)
    if model_type == "llama":
        from lmport.weights.gguf_config import GGUFLlamaConfig
        return GGUFLlamaConfig(**config)
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **config)


def config_fields(path: Path) -> tuple[str, dict]:
    """The transformers model type of a GGUF and the config fields its metadata gives (transformers_config)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    from lmport.weights.gguf_config import EXTRA_CONFIG_MAPPING, architecture_fields
    header, arch = read(path), architecture(path)
    meta = header.metadata
    model_type = _MODEL_TYPES.get(arch, arch)
    if arch == "llama" and meta.get("llama.expert_count"):
        model_type = "mixtral"
    elif arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type = "mistral"
    config = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}))
    table = EXTRA_CONFIG_MAPPING.get(model_type) or GGUF_CONFIG_MAPPING[
        {"gemma3_text": "gemma3", "mixtral": "llama"}.get(model_type, model_type)]
    for prefix, keys in ((arch, table), ("tokenizer", GGUF_CONFIG_MAPPING["tokenizer"])):
        config |= {hf: meta[f"{prefix}.{key}"] for key, hf in keys.items() if hf and f"{prefix}.{key}" in meta}
    if model_type == "mixtral":
        config |= {"num_local_experts": meta["llama.expert_count"],
                   "num_experts_per_tok": meta["llama.expert_used_count"]}
    config.setdefault("vocab_size", meta.get("tokenizer.ggml.tokens"))   # a string array: its length
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in header.tensors)
    config |= architecture_fields(arch, model_type, meta, {t.name for t in header.tensors})
    if "rope_parameters" in config:
        config.pop("rope_theta", None)
    return model_type, config


def _not_loaded(tensor: str, meta: dict, arch) -> bool:
    """Tensors a file may hold that the model does not load: those it computes from its config, and the
    multi-token-prediction layers GLM-4.5's converter appends after the model's layers (transformers drops
    them too)."""
    if tensor in _CONFIG_TENSORS:
        return True
    extra = meta.get(f"{arch}.nextn_predict_layers", 0)
    return bool(extra) and (m := _LAYER.match(tensor)) is not None and (
        int(m[1]) >= meta[f"{arch}.block_count"] - extra)


def _int_weight(rows: np.ndarray, qtype) -> QuantizedWeight:
    """One Q4_0 / Q4_1 / Q8_0 tensor in the internal format (its bytes copied out of the mapped file)."""
    from gguf import GGMLQuantizationType as T
    if qtype == T.Q8_0:              # d: f16, qs: 32 x int8;           w = d * q
        b = rows.reshape(rows.shape[0], -1, 34)
        scales = _f16(b[..., 0:2])
        codes = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8)).flatten(1)
        return QuantizedWeight(codes, scales, torch.zeros_like(scales), 8, 32, zero_mins=True)
    if qtype == T.Q4_0:                      # d: f16, qs: 16 bytes;            w = d * (q - 8)
        b = rows.reshape(rows.shape[0], -1, 18)
        scales = _f16(b[..., 0:2])
        mins = scales * -8                   # exact: a power-of-two multiple
        packed = b[..., 2:]
    else:                                    # Q4_1 -- d, m: f16, qs: 16 bytes; w = d * q + m
        b = rows.reshape(rows.shape[0], -1, 20)
        scales, mins = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        packed = b[..., 4:]
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(packed)).flatten(1), scales, mins, 4, 32)


def _f16(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0])


def _tensor_view(array: np.ndarray) -> torch.Tensor:
    """A tensor over the read-only mapped file, not a copy; nothing writes to weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch's warning on a non-writable array
        return torch.from_numpy(array)


def _read_tensor(header: GGUFHeader, t: TensorInfo, dtype: torch.dtype, keep: bool):
    """A tensor's value: QuantizedWeight or GGMLWeight (quantized, ``keep``), else a float tensor."""
    import gguf
    int_types, float_types = _types()
    qtype, data = _qtype(t), header.data(t)
    label = f"{t.name} ({qtype.name})"
    if qtype in float_types:
        value = torch.from_numpy(np.array(data))
        value = (value.view(torch.bfloat16) if qtype == gguf.GGMLQuantizationType.BF16 else value).to(dtype)
        page_out([_tensor_view(data)])
        return value
    if keep and qtype in int_types and len(t.shape) in (2, 3):
        weight = _int_weight(data, qtype).check(label)
        page_out([_tensor_view(data)])   # copied: the file's pages need not stay resident beside the copy
        return weight
    if keep and qtype.name.lower() in HELD_BLOCK_TYPES and len(t.shape) in (2, 3):
        return GGMLWeight(_tensor_view(data), qtype.name.lower(), t.shape[-1]).check(label)
    try:
        w = gguf.quants.dequantize(np.asarray(data), qtype)
    except NotImplementedError:
        raise ConfigError(f"{t.name}: GGUF tensor type {qtype.name} cannot be read (gguf has no "
                          f"dequantizer for it); requantize the file to a type lmport runs") from None
    return torch.from_numpy(np.asarray(w, dtype=np.float32)).to(dtype).reshape(t.shape)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp stores Llama's q/k rows interleaved for its rotary; this index undoes it
    (transformers' reverse permutation, applied to whole rows, so it works on quantized rows too)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _rows(value, index: torch.Tensor):
    """The output rows ``index`` of a float tensor or a quantized weight (a copy). Blocks viewed from the
    mapped file are paged out once copied: the file's pages would otherwise stay resident beside the copy."""
    if isinstance(value, torch.Tensor):
        return value[index]
    picked = value.rows(index)
    if isinstance(value, GGMLWeight):
        page_out([value.blocks])
    return picked


def _row_range(value, start: int, stop: int):
    """Rows ``start:stop`` of a float tensor or a quantized weight; a view (of the mapped file, for blocks)."""
    return value[start:stop] if isinstance(value, torch.Tensor) else row_range(value, start, stop)


def quantized_stacked_experts(path: Path) -> list[TensorInfo]:
    """The file's stacked expert tensors that load quantized (header only; empty for a dense model)."""
    int_types, _ = _types()
    return [t for t in read(path).tensors if _STACKED_EXPERTS.search(t.name) and len(t.shape) == 3
            and (_qtype(t) in int_types or _qtype(t).name.lower() in HELD_BLOCK_TYPES)]


def check_expert_split(path: Path, tp: int) -> None:
    """ConfigError, from the header alone, where ``tp`` ranks cannot split the file's quantized experts by their
    intermediate dimension: each rank's down projection takes inputs [r * inter / tp, (r + 1) * inter / tp),
    which must be whole blocks of its type (32 values for Q4_0..Q8_0, Q5_x, IQ4_NL and MXFP4, 256 for the K-quants
    and IQ4_XS). Gate and up split by whole rows, which any type allows."""
    int_types, _ = _types()
    for t in quantized_stacked_experts(path):
        if ".ffn_down_exps." not in t.name:
            continue
        kind = _qtype(t).name
        elements = 32 if _qtype(t) in int_types else HELD_BLOCK_TYPES[kind.lower()].elements
        inter = t.shape[-1]
        if inter % (tp * elements):
            working = [n for n in range(1, inter // elements + 1) if inter % (n * elements) == 0]
            raise ConfigError(
                f"tp={tp}: {path.name}'s {t.name} ({kind}, {elements}-value blocks) would give each rank "
                f"{inter / tp:g} of its {inter} inputs (the experts' intermediate size), not a whole number of "
                f"blocks; {SPLIT_FIX} (tp in {working} splits {t.name} into whole blocks)")


def split_experts_per_rank(path: Path, tp: int) -> tuple[int, dict[str, int]]:
    """(parameters, bytes by format: "int4", "int8" or a block type) of the quantized stacked experts each of ``tp``
    ranks holds (equal slices: check_expert_split), from the header alone."""
    int_types, _ = _types()
    params, held = 0, {}
    for t in quantized_stacked_experts(path):
        params += int(np.prod(t.shape)) // tp
        kind = int_types.get(_qtype(t)) or _qtype(t).name.lower()
        held[kind] = held.get(kind, 0) + t.nbytes // tp
    return params, held


def _out_features(value) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else value.out_features


def checkpoint_names(model_names: list[str], model_type: str) -> list[str]:
    """The tensor names a converted checkpoint holds for a model with these parameter names: Phi-3's
    projections fused, MoE experts' gate_up as gate and up."""
    names = []
    for name in model_names:
        base = name.removesuffix(".weight")
        if model_type == "phi3":
            fused = [f for f, parts in _PHI3_FUSED.items() if base.endswith(parts[0])]
            if fused:
                names.append(base[:-len(_PHI3_FUSED[fused[0]][0])] + fused[0] + ".weight")
            if any(base.endswith(p) for parts in _PHI3_FUSED.values() for p in parts):
                continue
        # (Llama 4's experts are under feed_forward; the bias is gpt-oss's)
        if base.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):
            names += [name.replace("gate_up_proj", "gate_proj"), name.replace("gate_up_proj", "up_proj")]
            continue
        names.append(name)
    return names


def load_tensors(path: Path, cfg, dtype: torch.dtype, model_names: list[str],
                 keep_quantized: bool, experts_only: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(quantized weights, float tensors) under the names of ``model_names`` (the model's parameters,
    transformers' names). Quantized tensors are dequantized to ``dtype`` unless ``keep_quantized``;
    ``experts_only`` (tensor parallelism): the stacked experts alone stay quantized, every other tensor loads
    in ``dtype`` to be sharded as a float checkpoint's.
    ValueError naming the tensor when one has no place in the model or the model misses one."""
    import gguf
    header, arch = read(path), architecture(path)
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    wanted = {}
    for hf in checkpoint_names(model_names, cfg.model_type):
        base, _, suffix = hf.rpartition(".")
        parameter = next((p for p in _LINEAR_PARAMETERS if hf.endswith(p)), None)
        if arch in _LINEAR_ATTENTION and parameter is not None:
            module, tensor_suffix = _LINEAR_PARAMETERS[parameter]
            wanted[f"{name_map.get_name(hf.removesuffix(parameter) + module)}{tensor_suffix}"] = hf
        elif suffix in ("weight", "bias") and (g := name_map.get_name(base)) is not None:
            wanted[f"{g}.{suffix}"] = hf
        elif (g := name_map.get_name(hf)) is not None:   # a parameter without a suffix (stacked experts)
            wanted[f"{g}.weight"] = hf
        elif hf.endswith("_bias") and (g := name_map.get_name(hf.removesuffix("_bias"))) is not None:
            wanted[f"{g}.bias"] = hf   # a bias buffer (GLM's e_score_correction_bias)
    values, dequantized, float_types = {}, set(), _types()[1]
    read_ahead(_tensor_view(header.mapped[header.data_start:]))   # every tensor is read: one read, not faults
    for t in header.tensors:
        if _not_loaded(t.name, header.metadata, arch):
            continue
        hf = wanted.get(t.name)
        if hf is None:
            raise ValueError(f"{path.name}: GGUF tensor {t.name!r} has no place in the {cfg.model_type} model "
                             f"built from the file's metadata ({cfg.num_hidden_layers} layers)")
        keep = keep_quantized and (not experts_only or _STACKED_EXPERTS.search(t.name) is not None)
        value, qtype = _read_tensor(header, t, dtype, keep), _qtype(t)
        if isinstance(value, torch.Tensor) and qtype not in float_types and keep:
            dequantized.add(qtype.name)
        if isinstance(value, torch.Tensor):
            want, got = t.shape, tuple(value.shape)
        else:   # a stacked (experts') tensor is held as one weight of all its rows
            want, got = (int(np.prod(t.shape[:-1])), t.shape[-1]), (value.out_features, value.in_features)
        if got != want:
            raise ValueError(f"{path.name}: tensor {t.name!r} reads as {list(got)}, its header says {list(want)}")
        values[hf] = value
    missing = sorted(set(wanted.values()) - set(values))
    if missing:
        raise ValueError(f"{path.name}: no tensor for {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''} ({cfg.model_type}, {cfg.num_hidden_layers} layers)")
    _undo_conversion(values, arch, cfg, dtype)
    if dequantized and keep_quantized:
        log.info("%s: %s dequantized to %s (no kernel form)", path.name, ", ".join(sorted(dequantized)),
                 str(dtype).removeprefix("torch."))
    quantized = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    return quantized, {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}


def _undo_conversion(values: dict, arch: str, cfg, dtype: torch.dtype) -> None:
    """Undo, in place, what llama.cpp's converter changed in the tensors of ``arch``."""
    from lmport.models.dims import head_dim_of
    for name in list(values):
        if name not in values:   # consumed with its partner (an expert's up beside its gate)
            continue
        value = values[name]
        if arch in _PERMUTED_QK and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                   "self_attn.q_proj.bias", "self_attn.k_proj.bias")):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            values[name] = _rows(value, _unpermute_rows(_out_features(value), heads))
        elif (arch in ("gemma2", "gemma3") or arch in _LINEAR_ATTENTION and not name.endswith(
                "linear_attn.norm.weight")) \
                and name.endswith("norm.weight"):
            values[name] = value - 1   # stored as 1 + w (Qwen3-Next's gated norm is stored as it is)
        elif arch in _LINEAR_ATTENTION and name.endswith("linear_attn.A_log"):
            values[name] = torch.log(-value)   # stored as A = -exp(A_log)
        elif arch in _LINEAR_ATTENTION and name.endswith("linear_attn.conv1d.weight"):
            values[name] = value.unsqueeze(1)   # stored squeezed: [channels, kernel]
        elif arch in _LINEAR_ATTENTION and name.endswith("mlp.shared_expert_gate.weight"):
            values[name] = value.reshape(1, -1)   # one output row; llama-quantize drops its dimension of 1
        elif arch == "gpt-oss" and name.endswith("mlp.experts.gate_proj"):
            _biased_experts(values, name.removesuffix(".gate_proj"), cfg.num_local_experts, dtype)
        elif arch == "llama4" and name.endswith("feed_forward.experts.gate_proj"):
            _llama4_experts(values, name.removesuffix(".gate_proj"), cfg.num_local_experts, dtype)
        elif arch == "llama4" and not isinstance(value, torch.Tensor) and name.endswith(
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            # each head's interleaved rotary pairs to halves (float rows: Llama4CausalLM.shard_state_dict)
            from lmport.models.llama4 import interleaved_to_halves
            values[name] = _rows(value, interleaved_to_halves(torch.arange(_out_features(value)), head_dim_of(cfg)))
        elif name.endswith("mlp.experts.gate_proj"):
            experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
            _experts(values, name.removesuffix(".gate_proj"), experts, dtype)
        elif arch == "deepseek2" and isinstance(value, torch.Tensor) and name.endswith(
                ("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")):
            values[name] = value.flatten(0, -2)   # [heads, rows, in] as the converter writes it: each head's rows
        elif arch == "deepseek2" and not isinstance(value, torch.Tensor) and name.endswith(
                ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")):
            values[name] = _rows(value, _rope_halves(_out_features(value), cfg, "kv_a" in name))
        elif arch == "phi3" and name.removesuffix(".weight").endswith(tuple(_PHI3_FUSED)):
            fused = next(f for f in _PHI3_FUSED if name.removesuffix(".weight").endswith(f))
            d = head_dim_of(cfg)
            sizes = ([cfg.num_attention_heads * d] + [cfg.num_key_value_heads * d] * 2 if "qkv" in fused
                     else [_out_features(value) // 2] * 2)
            prefix, start = name[:-len(fused + ".weight")], 0
            for part, size in zip(_PHI3_FUSED[fused], sizes, strict=True):
                values[f"{prefix}{part}.weight"] = _row_range(value, start, start + size)
                start += size
            del values[name]


def _rope_halves(rows: int, cfg, latent: bool) -> torch.Tensor:
    """The row order DeepSeek-V3's model takes its rotary rows in (halves), from the checkpoint's interleaved
    pairs, for a quantized q projection (each head: nope rows, then rope) or kv_a_proj_with_mqa (the latent's
    rows, then rope). Float tensors are reordered by the model itself (DeepseekV3CausalLM.shard_state_dict)."""
    from lmport.models.deepseek_v3 import interleaved_to_halves
    index, nope, rope = torch.arange(rows), cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if latent:
        return torch.cat([index[:cfg.kv_lora_rank], interleaved_to_halves(index[cfg.kv_lora_rank:])])
    heads = index.unflatten(0, (-1, nope + rope))
    return torch.cat([heads[:, :nope], interleaved_to_halves(heads[:, nope:].T).T], dim=1).flatten()


def _experts(values: dict, prefix: str, num_experts: int, dtype: torch.dtype) -> None:
    """A MoE block's stacked experts (``prefix``.gate_proj / up_proj / down_proj): kept as they are where all
    three are quantized (lmport.models.quantized.QuantExperts runs them), else float with gate and up
    concatenated into transformers' ``gate_up_proj`` [experts, 2 * inter, hidden] (a quantized part of a
    mixed set dequantized: the float experts op takes float weights only)."""
    from lmport import ops
    parts = [f"{prefix}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    if not any(isinstance(values[p], torch.Tensor) for p in parts):
        return
    for p in parts:
        if isinstance(w := values[p], GGMLWeight):
            values[p] = ops.dequantize_ggml(w, dtype).reshape(num_experts, -1, w.in_features)
        elif isinstance(w, QuantizedWeight):
            values[p] = ops.dequantize(w, dtype).reshape(num_experts, -1, w.in_features)
    values[f"{prefix}.gate_up_proj"] = torch.cat([values.pop(parts[0]), values.pop(parts[1])], dim=1)


def _biased_experts(values: dict, prefix: str, num_experts: int, dtype: torch.dtype) -> None:
    """gpt-oss's stacked experts (``prefix``.gate_proj / up_proj / down_proj [experts x rows, in], each with a
    ``_bias`` [experts, rows]): kept as they are where all three are quantized (the file's MXFP4 or other
    blocks; lmport.models.gpt_oss.QuantBiasedExperts runs them), else float in transformers' layout:
    ``gate_up_proj`` [experts, hidden, 2 * inter] with the gate's and up's columns interleaved (gate even) as
    the converter took them apart, its bias likewise, ``down_proj`` [experts, inter, hidden]."""
    parts = [f"{prefix}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    if (stacked := _float_experts(values, parts, num_experts, dtype)) is None:
        return
    gate, up, down = stacked
    values[f"{prefix}.gate_up_proj"] = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()
    values[f"{prefix}.down_proj"] = down.transpose(1, 2).contiguous()
    biases = [values.pop(f"{p}_bias") for p in parts[:2]]
    values[f"{prefix}.gate_up_proj_bias"] = torch.stack(biases, dim=2).flatten(1, 2)
    values[f"{prefix}.down_proj_bias"] = values.pop(f"{parts[2]}_bias")


def _llama4_experts(values: dict, prefix: str, num_experts: int, dtype: torch.dtype) -> None:
    """Llama 4's stacked experts: kept as they are where all three are quantized (lmport.models.quantized.QuantExperts
    with ``scale_inputs`` runs them), else float in transformers' layout: ``gate_up_proj`` [experts, hidden,
    2 * inter] (the gate's columns, then up's), ``down_proj`` [experts, inter, hidden]."""
    parts = [f"{prefix}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    if (stacked := _float_experts(values, parts, num_experts, dtype)) is None:
        return
    gate, up, down = stacked
    values[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1).transpose(1, 2).contiguous()
    values[f"{prefix}.down_proj"] = down.transpose(1, 2).contiguous()


def rope_frequency_factors(path: Path) -> torch.Tensor | None:
    """The file's ``rope_freqs.weight`` (float32), or None: what llama.cpp's converter writes for a llama3-type rope
    scaling instead of its config keys (llama.cpp divides each rotary frequency by its factor)."""
    header = read(path)
    t = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    value = None if t is None else _read_tensor(header, t, torch.float32, keep=False)   # keep=False: a float tensor
    return value if isinstance(value, torch.Tensor) else None


def _float_experts(values: dict, parts: list[str], num_experts: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """None where the stacked expert weights ``parts`` are all quantized (kept so); else each taken out of
    ``values`` as float [experts, rows, in] (a quantized part of a mixed set dequantized to ``dtype``)."""
    if not any(isinstance(values[p], torch.Tensor) for p in parts):
        return None
    return [(w := _float(values.pop(p), dtype)).reshape(num_experts, -1, w.shape[-1]) for p in parts]


def _float(value, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as it is, or a quantized weight dequantized to ``dtype`` ([out, in])."""
    from lmport import ops
    if isinstance(value, GGMLWeight):
        return ops.dequantize_ggml(value, dtype)
    if isinstance(value, QuantizedWeight):
        return ops.dequantize(value, dtype)
    return value


def planned_bytes(path: Path, dtype: torch.dtype) -> dict[str, int]:
    """Bytes the loaded weights will take, by format ("int4", "int8", a block type such as "q4_k", or the
    compute dtype's name), from the GGUF header alone: what ``load_tensors`` keeps."""
    int_types, _ = _types()
    by_format: dict[str, int] = {}
    float_name = str(dtype).removeprefix("torch.")
    header = read(path)
    for t in header.tensors:
        numel, qtype = int(np.prod(t.shape)), _qtype(t)
        name = qtype.name.lower()
        if _not_loaded(t.name, header.metadata, header.metadata.get("general.architecture")):
            continue
        if qtype in int_types and len(t.shape) in (2, 3):
            key = int_types[qtype]
            size = numel * int(key[3:]) // 8 + numel // 32 * 2 * 2   # codes + float16 scale and min a run
        elif name in HELD_BLOCK_TYPES and len(t.shape) in (2, 3):
            key, size = name, t.nbytes
        else:
            key, size = float_name, numel * dtype.itemsize
        by_format[key] = by_format.get(key, 0) + size
    return by_format
