"""A Llama GGUF's config (lmport.weights.gguf_config.GGUFLlamaConfig) is the LlamaConfig transformers makes of
the same fields, and a GGUF load imports neither ``transformers.activations`` nor ``torch._dynamo``.

Files: the default model (quick) and the tiny Llama of tests/support/tiny_hf_models.py written as GGUF (slow).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from lmport.models.loader import resolve_model_path
from lmport.weights import gguf
from lmport.weights.gguf_config import GGUFLlamaConfig, as_transformers_config
from support.tiny_hf_models import gguf_file


def _path(name: str) -> Path:
    return resolve_model_path("smollm2") if name == "smollm2" else gguf_file(name)


def test_fields_and_defaults_are_llama_configs():
    from transformers import LlamaConfig
    ours = {f.name: (f.default, f.default_factory) for f in dataclasses.fields(GGUFLlamaConfig)}
    theirs = {f.name: (f.default, f.default_factory) for f in dataclasses.fields(LlamaConfig)}
    assert ours == theirs
    assert GGUFLlamaConfig.model_type == LlamaConfig.model_type
    assert GGUFLlamaConfig().to_dict() == LlamaConfig().to_dict()


@pytest.mark.parametrize("name", ["smollm2", pytest.param("llama", marks=pytest.mark.slow)])
def test_config_is_transformers_config(name):
    from transformers import AutoConfig, LlamaConfig
    path = _path(name)
    model_type, fields = gguf.config_fields(path)
    assert model_type == "llama"
    ours = gguf.transformers_config(path)
    ref = AutoConfig.for_model(model_type, **fields)
    assert isinstance(ours, GGUFLlamaConfig)
    assert ours.to_dict() == ref.to_dict()
    assert vars(ours) == vars(ref)
    assert ours.head_dim == ref.head_dim and ours.rope_parameters == ref.rope_parameters
    back = as_transformers_config(ours)
    assert type(back) is LlamaConfig and back.to_dict() == ref.to_dict()


def test_default_model_load_imports_no_dynamo():
    """Config, tokenizer and model of the default model: no ``transformers.activations`` (imported by every
    transformers model config module) and no ``torch._dynamo`` (imported by ``nn.init.normal_`` on the meta
    device): seconds of a cold load, and over 100 MiB of RSS."""
    code = ("import sys, torch\n"
            "from lmport.backends.cpu import CpuBackend\n"
            "from lmport.models.loader import load_model\n"
            "load_model('smollm2', CpuBackend(), torch.float32)\n"
            "print(sorted(m for m in ('transformers.activations', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
