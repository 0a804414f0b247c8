"""GGUF files of the newer families (SmolLM3, GLM-4.5, DeepSeek-V3, Qwen3-Next) made by llama.cpp's own converter,
loaded by lmport (slow).

llama.cpp is found as tests/test_gguf_llama_cpp.py finds it, and without its ``convert_hf_to_gguf.py`` (and
its requirement ``sentencepiece``) or ``llama-quantize`` the tests are skipped, saying so.

Files: the tiny random-weight models of tests/support/tiny_float_models.py saved as transformers directories,
converted with ``convert_hf_to_gguf.py --outtype q8_0``, and with ``--outtype f16`` then ``llama-quantize`` to
Q4_K_M. The converter reads GLM's vocabulary by GLM's special tokens (``[gMASK]``, ``<|user|>``,
``<|observation|>``), so the GLM model's copy of the default tokenizer has three of its added tokens renamed
to them (same ids, same vocabulary size). DeepSeek-V3's source is tests/test_deepseek_v3.py's "q-lora" model (q
through a low rank, interleaved rotary under yarn) with the released config's ``"scoring_func": "sigmoid"`` and
``"topk_method": "noaux_tc"`` put back in its config.json (transformers' config class no longer writes them, and
without them the converter writes no gating function, which llama.cpp reads as DeepSeek-V2's softmax routing).
Qwen3-Next's is tests/test_qwen3_next.py's model with experts on every layer (llama.cpp's qwen3next has no dense
layer), converted with ``--no-mtp`` (it has no multi-token-prediction layer, which the converter asks for).

The reference is transformers' model of the source directory's config holding the file's tensors, each
dequantized by gguf-py's reference dequantizer and put back under transformers' names (gguf's own name map;
the q/k rows the converter interleaved for SmolLM3 put back in order; GLM's and DeepSeek's experts restacked;
DeepSeek's kv_b_proj put back together from the converter's two halves, attn_k_b transposed and attn_v_b;
Qwen3-Next's in_proj_qkvz regrouped from attn_qkv and attn_gate, its A_log, dt_bias, conv and 1 + w norms undone):
transformers' GGUF loader reads none of these architectures. For each file: lmport's greedy tokens (cpu, float32
compute, the weights kept quantized) against that model's, 16 prompts x 32 tokens, decoded together and each
alone, at least 15 of 16 identical either way; the weight bytes lmport holds at most 1.1x the file's tensor bytes. And
a damaged header field of each architecture is refused by name.
"""
from __future__ import annotations

import functools
import json
import re
import shutil
import sys
from pathlib import Path

import gguf
import pytest
import torch

from support import greedy
from support.gguf_files import dequantized_tensors, unpermute_qk, with_value
from support import tiny_float_models
from support.saved_dirs import move_into_place, own_tmp
from test_gguf_llama_cpp import _out_dir, _run, _tool, quantized

pytestmark = pytest.mark.slow

FAMILIES = {"smollm3": gguf.MODEL_ARCH.SMOLLM3, "glm4-moe": gguf.MODEL_ARCH.GLM4_MOE,   # tiny model -> GGUF
            "deepseek-v3": gguf.MODEL_ARCH.DEEPSEEK2, "qwen3-next": gguf.MODEL_ARCH.QWEN3NEXT}
# Keys of a released config.json that its transformers config class drops on saving, put back for the converter.
_RELEASED_KEYS = {"deepseek-v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
# The converter asks Qwen3-Next for its multi-token-prediction layer unless told to leave it out (none here).
_CONVERTER_FLAGS = {"qwen3-next": ["--no-mtp"]}


def tiny_config(arch: str):
    if arch == "deepseek-v3":
        import test_deepseek_v3
        return test_deepseek_v3.tiny_config("q-lora")
    if arch == "qwen3-next":   # tests/test_qwen3_next.py's, with experts on every layer (llama.cpp has no dense one)
        from support.qwen3_next_model import tiny_config as qwen3_next_config
        cfg = qwen3_next_config()
        cfg.mlp_only_layers = []
        return cfg
    return tiny_float_models.tiny_config(arch)


@functools.cache
def tiny_model_dir(arch: str) -> str:
    if arch == "deepseek-v3":
        import test_deepseek_v3
        return test_deepseek_v3.tiny_model_dir("q-lora")
    if arch == "qwen3-next":
        import hashlib

        from transformers import AutoModelForCausalLM

        import support.qwen3_next_model
        from support.model_helpers import saved_model
        from support.qwen3_next_model import _randomize

        def make():
            torch.manual_seed(6161)
            model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
            _randomize(model)
            return model
        digest = hashlib.sha256(Path(support.qwen3_next_model.__file__).read_bytes()).hexdigest()[:10]
        return saved_model(f"qwen3-next-tiny-all-experts-{digest}", make)
    return tiny_float_models.tiny_model_dir(arch)
PROMPTS, NEW_TOKENS = 16, 32
# GLM's special tokens the converter looks up -> the default tokenizer's added tokens they replace.
_GLM_TOKENS = {"<repo_name>": "[gMASK]", "<reponame>": "<|user|>", "<file_sep>": "<|observation|>"}


def _source_dir(arch: str) -> Path:
    """The tiny model's directory as the converter is given it (GLM's: its tokenizer's tokens renamed; DeepSeek's:
    the released config's routing keys put back)."""
    source = Path(tiny_model_dir(arch))
    if arch in _RELEASED_KEYS:
        target = _out_dir() / f"{source.name}-released-keys"
        if not target.exists():
            tmp = own_tmp(target)
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp)
            config = json.loads((tmp / "config.json").read_text()) | _RELEASED_KEYS[arch]
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            move_into_place(tmp, target)
        return target
    if arch != "glm4-moe":
        return source
    target = _out_dir() / f"{source.name}-glm-vocab"
    if not target.exists():
        tmp = own_tmp(target)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        tokenizer = json.loads((tmp / "tokenizer.json").read_text())
        for token in tokenizer["added_tokens"]:
            token["content"] = _GLM_TOKENS.get(token["content"], token["content"])
        vocab = tokenizer["model"]["vocab"]
        for old, new in _GLM_TOKENS.items():
            vocab[new] = vocab.pop(old)
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer))
        move_into_place(tmp, target)
    return target


@functools.cache
def converted(arch: str, outtype: str) -> Path:
    """``convert_hf_to_gguf.py --outtype OUTTYPE`` of the tiny model (run with this environment's python)."""
    convert = _tool("convert_hf_to_gguf.py")
    source = _source_dir(arch)
    out = _out_dir() / f"tiny-{arch}-{Path(tiny_model_dir(arch)).name}-{outtype.upper()}.gguf"
    if not out.exists():
        tmp = own_tmp(out)
        _run([sys.executable, convert, source, "--outtype", outtype, "--outfile", tmp, "--model-name", "tiny-random",
              *_CONVERTER_FLAGS.get(arch, [])])
        tmp.replace(out)
    return out


def gguf_file(arch: str, preset: str) -> Path:
    return converted(arch, "q8_0") if preset == "Q8_0" else quantized(converted(arch, "f16"), preset)


def reference_model(arch: str, path: Path):
    """transformers' model of the tiny model's config holding the file's dequantized tensors."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    deq = {name: torch.from_numpy(value.copy()) for name, value in dequantized_tensors(path).items()}
    names = gguf.get_tensor_name_map(FAMILIES[arch], cfg.num_hidden_layers)
    state = {}
    for name in model.state_dict():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            state[name] = torch.cat([deq[f"{names.get_name(base + '.gate_proj')}.weight"],
                                     deq[f"{names.get_name(base + '.up_proj')}.weight"]], dim=1)
        elif name.endswith("mlp.experts.down_proj"):
            state[name] = deq[f"{names.get_name(name)}.weight"]
        elif name.endswith("e_score_correction_bias"):
            state[name] = deq[f"{names.get_name(name.removesuffix('_bias'))}.bias"]
        elif arch == "qwen3-next" and ".linear_attn." in name:
            state[name] = _qwen3_next_linear(cfg, name, deq, names)
        elif name.endswith("self_attn.kv_b_proj.weight"):   # [heads, rank, nope] transposed, then [heads, v, rank]
            base = name.removesuffix(".kv_b_proj.weight")
            keys = deq[f"{names.get_name(base + '.k_b_proj')}.weight"].transpose(1, 2)
            state[name] = torch.cat([keys, deq[f"{names.get_name(base + '.v_b_proj')}.weight"]], dim=1).flatten(0, 1)
        else:
            value = deq[names.get_name(name, try_suffixes=(".weight", ".bias"))]
            if arch == "smollm3" and re.search(r"\.[qk]_proj\.(weight|bias)$", name):
                heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
                value = unpermute_qk(value, heads)
            if arch == "qwen3-next" and name.endswith("norm.weight"):
                value = value - 1   # stored as 1 + w
            if arch == "qwen3-next" and name.endswith("shared_expert_gate.weight"):
                value = value.reshape(1, -1)   # llama-quantize drops its output dimension of 1
            state[name] = value
    model.load_state_dict(state, strict=True)
    return model


def _qwen3_next_linear(cfg, name: str, deq: dict, names) -> torch.Tensor:
    """A Qwen3-Next linear-attention parameter from the converter's tensors: in_proj_qkvz regrouped by key head
    from ``attn_qkv`` (q, k, v of all heads, the conv's channel order) and ``attn_gate`` (z), A_log from
    ``ssm_a`` = -exp(A_log), dt_bias from ``ssm_dt.bias``, the conv weight unsqueezed; the rest as stored."""
    layer = name[:name.index(".linear_attn.") + len(".linear_attn.")]

    def tensor(module: str, suffix: str = ".weight") -> torch.Tensor:
        return deq[f"{names.get_name(layer + module)}{suffix}"]
    if name.endswith("in_proj_qkvz.weight"):
        heads, group = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
        keys, values = heads * cfg.linear_key_head_dim, heads * group * cfg.linear_value_head_dim
        q, k, v = tensor("in_proj_qkv").split([keys, keys, values])
        z = tensor("in_proj_z")
        return torch.cat([t.unflatten(0, (heads, -1)) for t in (q, k, v, z)], dim=1).flatten(0, 1)
    if name.endswith("A_log"):
        return torch.log(-tensor("A_log", ""))
    if name.endswith("dt_bias"):
        return tensor("dt_proj", ".bias")
    if name.endswith("conv1d.weight"):
        return tensor("conv1d").unsqueeze(1)
    return tensor(name[len(layer):].removesuffix(".weight"))


@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_tiny_models_converted_by_llama_cpp(arch, preset):
    import lmport
    from lmport import EngineConfig
    path = gguf_file(arch, preset)
    ids = greedy.prompts(PROMPTS)
    want = greedy.hf_greedy(reference_model(arch, path), ids, NEW_TOKENS)
    cfg = EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=256)
    with lmport.pipeline(str(path), backend_config=cfg) as pipe:
        greedy.check_file(pipe, path, ids, want, NEW_TOKENS)


DAMAGED = [("smollm3", "smollm3.block_count", 10**9, r"smollm3\.block_count is 1000000000, should be 4"),
           ("smollm3", "smollm3.attention.head_count", 8, r"smollm3\.attention\.head_count is 8, should be 4"),
           ("smollm3", "smollm3.rope.dimension_count", 32, r"smollm3\.attention\.head_count is 4, should be 2: .*"
                                                                r"\(smollm3\.rope\.dimension_count\)"),
           # GLM's converter counts the multi-token-prediction layer in block_count (5 for 4 layers held)
           ("glm4-moe", "glm4moe.block_count", 10**9, r"glm4moe\.block_count is 1000000000, should be 4"),
           ("glm4-moe", "glm4moe.block_count", 3, r"glm4moe\.block_count is 3, should be 4"),
           ("glm4-moe", "glm4moe.expert_count", 1000, r"glm4moe\.expert_count is 1000, should be 8"),
           ("glm4-moe", "glm4moe.expert_used_count", 9, r"glm4moe\.expert_used_count is 9, should be at most"),
           ("glm4-moe", "glm4moe.expert_feed_forward_length", 64,
            r"glm4moe\.expert_feed_forward_length is 64, should be 32"),
           ("glm4-moe", "glm4moe.attention.key_length", 32, r"glm4moe\.attention\.head_count is 4, should be 2"),
           ("deepseek-v3", "deepseek2.block_count", 2, r"deepseek2\.block_count is 2, should be 3"),
           ("deepseek-v3", "deepseek2.expert_count", 1000, r"deepseek2\.expert_count is 1000, should be 8"),
           # softmax: DeepSeek-V2's routing, which llama.cpp also assumes where the key is missing
           ("deepseek-v3", "deepseek2.expert_gating_func", 1,
            r"deepseek2\.expert_gating_func is 1: lmport runs DeepSeek-V3's sigmoid routing"),
           ("qwen3-next", "qwen3next.block_count", 5, r"qwen3next\.block_count is 5, should be 4"),
           ("qwen3-next", "qwen3next.expert_count", 1000, r"qwen3next\.expert_count is 1000, should be 4")]


@pytest.mark.parametrize(("arch", "key", "value", "message"), DAMAGED, ids=[f"{k}={v}" for _, k, v, _ in DAMAGED])
def test_a_damaged_header_of_a_new_family_is_refused_by_name(tmp_path, arch, key, value, message):
    import lmport
    from lmport import EngineConfig
    from lmport.errors import ConfigError
    path = with_value(converted(arch, "q8_0"), key, value, tmp_path / "damaged.gguf")
    with pytest.raises(ConfigError, match=message):
        lmport.pipeline(str(path), backend_config=EngineConfig(device_type="cpu"))
