"""GGUF files of gpt-oss, Qwen3.5 and Llama 4 made by llama.cpp's own tools from tiny random-weight transformers
checkpoints, and transformers' model holding each file's dequantized tensors (the reference lmport is compared
with).

Files: the tiny directory converted with ``convert_hf_to_gguf.py --outtype OUTTYPE`` (run with this environment's
python; the converter needs ``sentencepiece`` importable), then, for a preset, ``llama-quantize`` of the F16 file
(``MXFP4_MOE``: the experts in MXFP4 and the rest Q8_0, as the released gpt-oss GGUFs are). llama.cpp is found as
tests/test_gguf_llama_cpp.py finds it; without it the tests are skipped, saying so.

The reference: transformers' model of the source directory's config whose every tensor is the file's, dequantized
by gguf-py's reference dequantizer (``gguf.quants.dequantize``; MXFP4 included) and put back under transformers'
names, undoing what the converter changed (gpt-oss's interleaved gate/up split apart and its experts transposed).
transformers' GGUF loader reads none of these architectures.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from support.gguf_files import dequantized_tensors
from support.saved_dirs import own_tmp

GGUF_ARCH = {"gpt-oss": gguf.MODEL_ARCH.GPT_OSS, "qwen3.5": gguf.MODEL_ARCH.QWEN35,
             "qwen3.5-moe": gguf.MODEL_ARCH.QWEN35MOE, "llama4": gguf.MODEL_ARCH.LLAMA4,
             "llama4-rope-scaled": gguf.MODEL_ARCH.LLAMA4, "llama-rope-scaled": gguf.MODEL_ARCH.LLAMA}
# What a llama4 GGUF cannot say and llama.cpp assumes of every Llama 4 (the released models' values): chunks of
# 8192, the NoPE layers' temperature floor 8192. The tiny model's smaller ones are not in its file.
LLAMA4_FILE_FIELDS = {"attention_chunk_size": 8192, "floor_scale": 8192}
# Converter flags a family needs: Qwen3.5's converter asks for a multi-token-prediction layer unless told there
# is none (the tiny models have none).
_CONVERTER_FLAGS = {"qwen3.5": ["--no-mtp"], "qwen3.5-moe": ["--no-mtp"]}


def tiny_config(arch: str):
    """gpt-oss: tests/support/tiny_float_models.py's. Qwen3.5: tests/support/qwen3_5_model.py's text model
    (``qwen3_5_text`` with a dense MLP, ``qwen3_5_moe_text``): 2 key heads and 4 value heads in its linear
    layers, so the converter's reordering of value heads is there to undo."""
    if arch == "qwen3.5":
        from transformers import Qwen3_5TextConfig

        from support.qwen3_5_model import text_config_fields
        return Qwen3_5TextConfig(**text_config_fields(), intermediate_size=96)
    if arch == "qwen3.5-moe":
        from support.qwen3_5_model import tiny_config as qwen3_5_config
        return qwen3_5_config("moe")
    from support import tiny_float_models
    if arch == "llama-rope-scaled":   # Llama 3.1's llama3-type rope scaling, over a context of 32 positions
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=tiny_float_models.VOCAB, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                           initializer_range=0.2, rope_parameters={
                               "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "llama4-rope-scaled":   # Llama 4 Scout's llama3-type rope scaling, over a context of 32 positions
        cfg = tiny_float_models.tiny_config("llama4")
        return type(cfg)(**(cfg.to_dict() | {"rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}))
    return tiny_float_models.tiny_config(arch)


@functools.cache
def tiny_model_dir(arch: str) -> str:
    if arch == "qwen3.5":   # the text model alone: the converter reads the same tensors from an image-text one
        import hashlib

        from transformers import Qwen3_5ForCausalLM

        import support.qwen3_5_model
        from support.model_helpers import saved_model
        from support.qwen3_next_model import _randomize

        def make():
            torch.manual_seed(3535)
            model = Qwen3_5ForCausalLM(tiny_config(arch)).to(torch.float32).eval()
            _randomize(model)
            return model
        digest = hashlib.sha256(Path(support.qwen3_5_model.__file__).read_bytes()).hexdigest()[:10]
        return saved_model(f"qwen3_5-tiny-text-{digest}", make)
    if arch == "qwen3.5-moe":
        from support.qwen3_5_model import tiny_model_dir as qwen3_5_dir
        return qwen3_5_dir("moe")
    if arch in ("llama4-rope-scaled", "llama-rope-scaled"):
        from transformers import AutoModelForCausalLM

        from support import tiny_float_models
        from support.model_helpers import saved_model

        def make_scaled():
            torch.manual_seed(4044)
            model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
            tiny_float_models.randomize_constants(model)
            return model
        return saved_model(f"float-tiny-{arch}-{tiny_float_models._version()}", make_scaled)
    from support import tiny_float_models
    return tiny_float_models.tiny_model_dir(arch)


# The converter loads the tokenizer with transformers' AutoTokenizer, which gives a qwen3_5_moe_text directory
# transformers' Qwen3.5 tokenizer class whatever its tokenizer_config says; over the tiny models' (the default
# model's) vocabulary that class's pre-tokenizer is none the converter knows. Run so, the converter takes the
# directory's own tokenizer, as it does for a released Qwen3.5 (whose tokenizer it knows).
_CONVERT_WITH_OWN_TOKENIZER = """
import os, runpy, sys
from transformers.models.auto import tokenization_auto as auto
auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard("qwen3_5_moe_text")
auto.TOKENIZER_MAPPING_NAMES["qwen3_5_moe_text"] = "TokenizersBackend"
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))   # as running the script puts its directory first
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@functools.cache
def converted(arch: str, outtype: str) -> Path:
    """``convert_hf_to_gguf.py --outtype OUTTYPE`` of the tiny model, made once into lmport's cache."""
    from test_gguf_llama_cpp import _out_dir, _run, _tool
    convert = _tool("convert_hf_to_gguf.py")
    source = Path(tiny_model_dir(arch))
    out = _out_dir() / f"tiny-{arch}-{source.name}-{outtype.upper()}.gguf"
    if not out.exists():
        tmp = own_tmp(out)
        _run([sys.executable, "-c", _CONVERT_WITH_OWN_TOKENIZER, convert, source, "--outtype", outtype, "--outfile",
              tmp, "--model-name", "tiny-random", *_CONVERTER_FLAGS.get(arch, [])])
        tmp.replace(out)
    return out


def gguf_file(arch: str, kind: str) -> Path:
    """The tiny model's file: ``Q8_0`` or ``F16`` straight from the converter, else the F16 file through
    ``llama-quantize`` to the preset ``kind`` (``MXFP4_MOE``, ``Q4_K_M``)."""
    from test_gguf_llama_cpp import quantized
    if kind in ("Q8_0", "F16", "F32"):
        return converted(arch, kind.lower())
    return quantized(converted(arch, "f16"), kind)


def reference_model(arch: str, path: Path):
    """transformers' model of the tiny model's config (Llama 4's: with what its file assumes,
    ``LLAMA4_FILE_FIELDS``) holding the file's dequantized tensors."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(arch)
    if arch.startswith("llama4"):
        cfg = type(cfg)(**(cfg.to_dict() | LLAMA4_FILE_FIELDS | {"layer_types": None}))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if arch == "llama-rope-scaled":   # q and k rows unpermuted, as for every llama file
        from support.gguf_files import hf_state_dict_from_gguf
        model.load_state_dict(hf_state_dict_from_gguf(cfg, path), strict=True)
        return model
    deq = {name: torch.from_numpy(np.array(value)) for name, value in dequantized_tensors(path).items()}
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg.num_hidden_layers)

    def tensor(hf_module: str, suffix: str = ".weight") -> torch.Tensor:
        return deq[f"{names.get_name(hf_module)}{suffix}"]
    state = {}
    for name in model.state_dict():
        if arch == "gpt-oss" and name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):   # gate even
            base, suffix = name.split(".gate_up_proj")[0], ".bias" if name.endswith("_bias") else ".weight"
            gate, up = tensor(base + ".gate_proj", suffix), tensor(base + ".up_proj", suffix)
            both = torch.stack([gate, up], dim=2).flatten(1, 2)   # [experts, 2 x inter(, hidden)]
            state[name] = both if suffix == ".bias" else both.transpose(1, 2)
        elif arch == "gpt-oss" and name.endswith("experts.down_proj"):   # stored [experts, out, in]
            state[name] = tensor(name).transpose(1, 2)
        elif name.endswith("experts.down_proj_bias"):
            state[name] = tensor(name.removesuffix("_bias"), ".bias")
        elif name.endswith("self_attn.sinks"):
            state[name] = tensor(name)
        elif arch.startswith("qwen3.5") and ".linear_attn." in name:
            state[name] = _qwen3_5_linear(cfg, name, tensor)
        elif arch.startswith("llama4") and name.endswith("experts.gate_up_proj"):   # [experts, hidden, gate + up]
            base = name.removesuffix(".gate_up_proj")
            state[name] = torch.cat([tensor(base + ".gate_proj"), tensor(base + ".up_proj")], dim=1).transpose(1, 2)
        elif arch.startswith("llama4") and name.endswith("experts.down_proj"):
            state[name] = tensor(name).transpose(1, 2)
        elif name.endswith("mlp.experts.gate_up_proj"):   # Qwen3.5-MoE: gate's rows, then up's
            base = name.removesuffix(".gate_up_proj")
            state[name] = torch.cat([tensor(base + ".gate_proj"), tensor(base + ".up_proj")], dim=1)
        elif name.endswith("mlp.experts.down_proj"):
            state[name] = tensor(name)
        else:
            state[name] = deq[names.get_name(name, try_suffixes=(".weight", ".bias"))]
            if arch.startswith("qwen3.5") and name.endswith("norm.weight"):
                state[name] = state[name] - 1   # stored as 1 + w
            if name.endswith("shared_expert_gate.weight"):
                state[name] = state[name].reshape(1, -1)   # llama-quantize drops its output dimension of 1
    model.load_state_dict(state, strict=True)
    return model


def _grouped(t: torch.Tensor, dim: int, key_heads: int, group: int, size: int) -> torch.Tensor:
    """Value heads along ``dim`` put back from the converter's tiled order ([group, key heads, size]: head j of
    key head i at j * key_heads + i) into transformers' grouped one ([key heads, group, size])."""
    shape = list(t.shape)
    tiled = t.reshape(*shape[:dim], group, key_heads, size, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def _qwen3_5_linear(cfg, name: str, tensor) -> torch.Tensor:
    """A Qwen3.5 linear-attention parameter from the converter's tensors: every value-head tensor's heads put back
    in grouped order (the converter tiles them over the key heads), A_log from ``ssm_a`` = -exp(A_log), dt_bias
    from ``ssm_dt.bias``, the conv weight unsqueezed."""
    layer = name[:name.index(".linear_attn.") + len(".linear_attn.")]
    part = name[len(layer):]
    heads, group = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    keys, v_dim = 2 * heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if part == "A_log":
        return _grouped(torch.log(-tensor(layer + "A_log", "")), 0, heads, group, 1)
    if part == "dt_bias":
        return _grouped(tensor(layer + "dt_proj", ".bias"), 0, heads, group, 1)
    value = tensor(layer + part.removesuffix(".weight"))
    if part in ("in_proj_qkv.weight", "conv1d.weight"):   # q and k as they are; v's rows (channels) regrouped
        value = torch.cat([value[:keys], _grouped(value[keys:], 0, heads, group, v_dim)])
        return value.unsqueeze(1) if part == "conv1d.weight" else value
    if part == "in_proj_z.weight":
        return _grouped(value, 0, heads, group, v_dim)
    if part in ("in_proj_a.weight", "in_proj_b.weight"):
        return _grouped(value, 0, heads, group, 1)
    if part == "out_proj.weight":
        return _grouped(value, 1, heads, group, v_dim)
    return value   # the gated norm's weight, shared by the heads


def hf_prompt_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of the prompt ``ids``, float32."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def lmport_prompt_logits(engine, ids: list[int], chunk_tokens: int) -> torch.Tensor:
    """lmport's logits at every position of the prompt ``ids`` (a fresh engine's only request), prefilled
    ``chunk_tokens`` at a time through its scheduler."""
    from support.model_helpers import logits_in_chunks
    _, chunks = logits_in_chunks(engine, ids, chunk_tokens)
    return torch.cat(chunks).float()
