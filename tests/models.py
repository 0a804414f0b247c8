"""Models for tests: the default model loaded once per process, and tiny random-weight ones.

Tiny models are built from transformers config classes with random weights
(seeded) and saved as safetensors directories beside the default model's
tokenizer, so they load through the same path as a real checkpoint.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def _tiny_config(arch: str):
    import transformers
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    raise ValueError(arch)


@functools.cache
def tiny_model_dir(arch: str) -> str:
    """A directory with a random-weight ``arch`` model and the default model's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmport.models.loader import cache_root, hf_directory
    target = cache_root() / "test-models" / f"tiny-{arch}-v1"
    if not (target / "config.json").exists():
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(hf_directory("smollm2")).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


@functools.cache
def hf_model(model: str):
    """transformers' own model (float32, eval) for a short name or a directory."""
    from transformers import AutoModelForCausalLM

    from lmport.models.loader import hf_directory
    return AutoModelForCausalLM.from_pretrained(hf_directory(model), dtype=torch.float32).eval()


def hf_greedy(model: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate(do_sample=False), one prompt at a time (no padding effects)."""
    hf = hf_model(model)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            out.append(gen[0, len(ids):].tolist())
    return out


def default_model_path() -> Path:
    from lmport.models.loader import hf_directory
    return hf_directory("smollm2")


@functools.cache
def tiny_tool_model_dir() -> str:
    """The tiny random-weight Qwen2 model with a Qwen 2.5-style chat template that teaches tools
    (tests/data/qwen2_5_tool_template.jinja, Hermes <tool_call> blocks), built locally."""
    from transformers import AutoTokenizer

    from lmport.models.loader import cache_root
    template = (Path(__file__).parent / "data" / "qwen2_5_tool_template.jinja").read_text()
    target = cache_root() / "test-models" / "tiny-qwen2-tools-v1"
    if not (target / "config.json").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.copytree(tiny_model_dir("qwen2"), tmp)
        tok = AutoTokenizer.from_pretrained(tmp)
        tok.chat_template = template
        tok.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
