"""The models the GPU kit runs: tiny random-weight ones, the default model (or a random stand-in of its shape),
and a Llama-3-8B-shaped random-weight one. Every one is a transformers directory (config, safetensors,
tokenizer), so lmport and transformers load the same files.

The tokenizer is the default model's, from ``tools/gpu/carry/smollm2`` (written by wheels.py) or, where
that folder is absent and the default model is installed, exported from it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CARRIED = HERE / "carry" / "smollm2"
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3-moe")
# The newer families' tiny models, made by the test suite's own builders: {name: (module under tests/, argument of
# its tiny_model)}.
NEWER_ARCHS = {
    "smollm3": ("support.tiny_float_models", "smollm3"), "glm4-moe": ("support.tiny_float_models", "glm4-moe"),
    "gpt-oss": ("support.tiny_float_models", "gpt-oss"), "llama4": ("support.tiny_float_models", "llama4"),
    "deepseek-v3": ("test_deepseek_v3", "q-lora"), "deepseek-v3-q-proj": ("test_deepseek_v3", "q-proj"),
    "qwen3-next": ("support.qwen3_next_model", 4), "qwen3.5-moe": ("support.qwen3_5_model", "moe"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B config.json).
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def cache_dir() -> Path:
    from lmport.models.loader import cache_root
    return cache_root() / "gpu-kit"


def default_model_files() -> Path:
    """A folder with the default model's config and tokenizer (no weights)."""
    if (CARRIED / "tokenizer.json").exists():
        return CARRIED
    target = cache_dir() / "smollm2"
    if not (target / "tokenizer.json").exists():
        from lmport.models.loader import DEFAULT_MODEL, load_tokenizer, read_model_config
        tmp = target.with_name(f"smollm2.tmp{os.getpid()}")
        load_tokenizer(DEFAULT_MODEL).save_pretrained(tmp)
        read_model_config(DEFAULT_MODEL).save_pretrained(tmp)
        _publish(tmp, target)
    return target


def _publish(tmp: Path, target: Path) -> None:
    try:
        tmp.rename(target)
    except OSError:   # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)


def _save(model, target: Path) -> Path:
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    src = default_model_files()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    _publish(tmp, target)
    return target


def test_module(name: str):
    """A module of the test suite (``support.model_helpers``, ``test_deepseek_v3``), imported as the tests do."""
    import importlib
    import sys
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    return importlib.import_module(name)


def tiny_config(arch: str):
    """The test suite's tiny configs (tests/support/model_helpers.py), so the kit runs the models the tests run."""
    return test_module("support.model_helpers")._tiny_config(arch)


def tiny_model_dir(arch: str) -> Path:
    target = cache_dir() / f"tiny-{arch}-v1"
    if not (target / "config.json").exists():
        if arch in NEWER_ARCHS:
            _save(newer_model(arch), target)
        else:
            from transformers import AutoModelForCausalLM
            torch.manual_seed(1234)
            _save(AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32), target)
    return target


def newer_model(arch: str):
    """A newer family's tiny random-weight model (float32), as the test suite builds it."""
    module, argument = NEWER_ARCHS[arch]
    return test_module(module).tiny_model(argument)


def default_model(gguf: str | None = None) -> tuple[str, str]:
    """(model, what it is): the default model's GGUF where one is given or installed, else random weights in
    the default model's shape (its config, its tokenizer)."""
    if gguf:
        return gguf, f"the default model's GGUF ({gguf})"
    try:
        from lmport.models.loader import DEFAULT_MODEL, resolve_model_path
        return str(resolve_model_path(DEFAULT_MODEL)), "the default model (its GGUF, installed)"
    except Exception:
        pass
    target = cache_dir() / "smollm2-random-v1"
    if not (target / "config.json").exists():
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(default_model_files())
        torch.manual_seed(1234)
        _save(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), target)
    return str(target), "random weights in the default model's shape (its GGUF is not on this machine)"


def llama3_8b_dir(layers: int = 32, device: str = "cuda") -> Path:
    """Llama-3-8B's shape with random bfloat16 weights (``layers`` of its 32), written once to the cache."""
    return llama_dir(f"llama3-8b-shape-{layers}l-v1", {**LLAMA3_8B, "num_hidden_layers": layers}, device)


def small_llama_dir() -> Path:
    """A two-layer Llama of whole 128 x 128 blocks (fp8's), bfloat16: the dry run's stand-in for Llama-3-8B."""
    shape = dict(LLAMA3_8B, vocab_size=49152, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    return llama_dir("llama-small-v1", shape, "cpu")


def llama_dir(name: str, shape: dict, device: str) -> Path:
    target = cache_dir() / name
    if not (target / "config.json").exists():
        from transformers import AutoModelForCausalLM, LlamaConfig
        torch.manual_seed(1234)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
        _save(model, target)
        del model
    return target


def describe(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        cfg = json.loads((p / "config.json").read_text())
        return {k: cfg.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size")}
    return {"file": p.name}
