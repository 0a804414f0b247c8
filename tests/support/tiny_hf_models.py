"""Tiny random-weight models of each architecture lmport runs, shaped for GGUF files.

Two layers, the default model's vocabulary (49,152 tokens: its tokenizer is copied into the files),
hidden sizes 128 or 256. Where the inputs of a weight are a multiple of 256 the K-quants apply; where
they are 128 llama-quantize's fallbacks do (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), so a
Q4_K_M file of these models holds Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors, as the public small-model
files do.

A GGUF states fewer settings than a config.json: what transformers' GGUF loader does not read from
the file it takes from the config class's defaults, and llama.cpp has its own. The configs below keep
those settings at the values all three agree on, so that a file means one model:

- Gemma 2 / 3: head_dim 256 (query_pre_attn_scalar defaults to 256; llama.cpp scales by 1/sqrt(head_dim)),
  the default soft caps for Gemma 2 (the loader reads neither), windows of 4096 (longer than the tests'
  sequences: llama.cpp's Gemma 3 layer pattern is its own);
- Qwen3: head_dim 128, the class default (the loader does not read ``attention.key_length`` for qwen3);
- Qwen3-MoE: every layer sparse, ``norm_topk_prob`` true and ``moe_intermediate_size`` 768 (what the loader
  assumes for a qwen3moe file);
- Phi-3: no rope scaling (Phi-3-mini-4k's; longrope's factors are tensors the loader does not read);
- Mistral / Mixtral: no sliding window (the "llama" architecture has no key for one).

``tests/models.py`` builds tiny models of the same classes for float checkpoints (hidden 64: no
K-quant would fit); these are built alike (seeded, ``from_config``) with GGUF-friendly shapes.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import torch

def _version() -> str:
    """A digest of these helpers' sources: cached files are rewritten when the code that makes them changes."""
    import hashlib
    here = Path(__file__).parent
    text = b"".join((here / f).read_bytes() for f in ("ggml_quantize.py", "gguf_files.py", "tiny_hf_models.py"))
    return hashlib.sha256(text).hexdigest()[:10]


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3-moe", "mixtral")
VOCAB = 49152


def tiny_config(arch: str):
    import transformers
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=4096,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    if arch == "llama":        # every weight's inputs a multiple of 256: K-quants throughout
        return transformers.LlamaConfig(**common, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                        num_key_value_heads=2, rope_theta=100000.0)
    if arch == "mistral":      # hidden 128: the fallbacks on every projection reading the hidden state
        return transformers.MistralConfig(**common, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=32, sliding_window=None)
    if arch == "qwen2":        # q/k/v biases; tied embeddings (Qwen2.5-0.5B's)
        return transformers.Qwen2Config(**dict(common, tie_word_embeddings=True), hidden_size=256,
                                        intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)
    if arch == "qwen3":        # q/k norms; head_dim 128 (4 x 128 = 512 attention width on a 128 hidden state)
        return transformers.Qwen3Config(**common, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=128)
    gemma = dict(common, tie_word_embeddings=True, head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                 sliding_window=4096, pad_token_id=0)
    if arch == "gemma2":
        return transformers.Gemma2Config(**gemma, hidden_size=128, intermediate_size=512)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**gemma, hidden_size=256, intermediate_size=512)
    if arch == "phi3":         # fused qkv (4 + 2 x 2 heads of 64 = 512 rows) and gate_up
        return transformers.Phi3Config(**common, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                       num_key_value_heads=2, pad_token_id=0, rope_scaling=None,
                                       original_max_position_embeddings=4096)
    if arch == "qwen3-moe":    # 8 experts, top 2 (llama-quantize puts attn_k / attn_v at Q8_0 for 8 experts)
        return transformers.Qwen3MoeConfig(**common, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=768, norm_topk_prob=True)
    if arch == "mixtral":      # 4 experts, top 2; GGUF architecture "llama" with ffn_*_exps
        return transformers.MixtralConfig(**common, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                          num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=None, rope_theta=1000000.0)
    raise ValueError(arch)


@functools.cache
def tiny_model(arch: str):
    """The random-weight transformers model (float32, eval), seeded per architecture."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(4321 + ARCHS.index(arch))
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():     # norms away from 1 (and Gemma's from 0) so that the norm changes are seen
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@functools.cache
def tiny_model_dir(arch: str) -> str:
    """``tiny_model(arch)`` saved as a transformers directory with the default model's tokenizer (the input
    llama.cpp's convert_hf_to_gguf.py takes)."""
    from lmport.models.loader import cache_root, load_tokenizer
    target = cache_root() / "test-models" / f"gguf-tiny-{arch}-{_version()}"
    if not (target / "config.json").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        tiny_model(arch).save_pretrained(tmp)
        load_tokenizer("smollm2").save_pretrained(tmp)
        # The default model's tokenizer is byte-level BPE: say so (Phi-3's converter reads a SentencePiece
        # tokenizer.model unless the class is GPT2Tokenizer, as Phi-4's is).
        config = tmp / "tokenizer_config.json"
        config.write_text(json.dumps(dict(json.loads(config.read_text()), tokenizer_class="GPT2Tokenizer"), indent=2))
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def gguf_file(arch: str, preset: str = "Q4_K_M") -> Path:
    """``tiny_model(arch)`` written as a GGUF (support.gguf_files.write_gguf) with ``preset``'s tensor types,
    cached under lmport's cache directory."""
    from lmport.models.loader import cache_root
    from support.gguf_files import write_gguf
    path = cache_root() / "test-models" / f"gguf-{_version()}" / f"tiny-{arch}-{preset}.gguf"
    if not path.exists():
        model = tiny_model(arch)
        write_gguf(path, model.config, model.state_dict(), preset)
    return path
