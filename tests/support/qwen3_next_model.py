"""A tiny random-weight Qwen3-Next (transformers' Qwen3NextConfig, float32) saved as a directory, and greedy
decoding through lmport's model over its paged cache and recurrent-state slots, driven step by step (for any
hybrid model: Qwen3.5's tests drive theirs with it too)."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from support.model_helpers import saved_model


def tiny_config(num_layers: int = 4):
    """Linear, linear, linear, full (the released models' pattern), cycled; 4 experts (top 2) with a shared
    expert on every layer but layer 1, which keeps a dense MLP (``mlp_only_layers``)."""
    from transformers import Qwen3NextConfig
    types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(num_layers)]
    return Qwen3NextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1], layer_types=types,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _randomize(model) -> None:
    """Norms away from their constant starts, so that a model ignoring them (or their 1 + w form) would differ."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.5)


def tiny_model(num_layers: int = 4):
    """A seeded random-weight model of ``tiny_config(num_layers)`` (float32, eval)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(61 + num_layers)
    model = AutoModelForCausalLM.from_config(tiny_config(num_layers), dtype=torch.float32).eval()
    _randomize(model)
    return model


@functools.cache
def tiny_model_dir(num_layers: int = 4) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]
    return saved_model(f"qwen3-next-tiny-{num_layers}-{digest}", lambda: tiny_model(num_layers))


def hf_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens (float32, its own cache), never stopping at an end-of-sequence token."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            got = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 min_new_tokens=new_tokens, pad_token_id=0)
            out.append(got[0, len(ids):].tolist())
    return out


def drive(model_dir: str, prompt_ids: list[list[int]], new_tokens: int, block_size: int,
          chunk: int) -> list[list[int]]:
    """Greedy tokens from the hybrid model (Qwen3-Next, Qwen3.5) of ``model_dir`` alone: every sequence in each
    step, prompts in chunks of ``chunk`` tokens, each sequence in its own state slot (in reverse order, so that
    slot and batch row differ)."""
    from lmport.backends.cpu import CpuBackend
    from lmport.kv.layout import KVLayout
    from lmport.kv.state_pool import StateTensors
    from lmport.models.loader import load_model
    from lmport.ops import build_attention_metadata
    model = load_model(model_dir, CpuBackend(), torch.float32).model
    kinds = model.cache_kinds(model.config)
    layout = KVLayout(len(kinds), kinds[0].num_heads, kinds[0].head_dim, block_size, torch.float32, layer_kinds=kinds)
    per_seq = -(-(max(map(len, prompt_ids)) + new_tokens) // block_size)
    caches = layout.allocate(per_seq * len(prompt_ids), "cpu")
    model.bind_states(StateTensors(model.recurrent_state(model.config, torch.float32), len(prompt_ids) + 1, "cpu"))
    seqs = [{"ids": list(p), "done": 0, "out": [], "table": list(range(i * per_seq, (i + 1) * per_seq)),
             "slot": len(prompt_ids) - i} for i, p in enumerate(prompt_ids)]
    while any(len(s["out"]) < new_tokens for s in seqs):
        live = [s for s in seqs if len(s["out"]) < new_tokens]
        tokens, q_lens, rows = [], [], []
        for s in live:
            n = min(chunk, len(s["ids"]) - s["done"])
            tokens += s["ids"][s["done"]:s["done"] + n]
            q_lens.append(n)
            rows.append(len(tokens) - 1)
        meta = build_attention_metadata(q_lens, [s["done"] + n for s, n in zip(live, q_lens)],
                                        [s["table"] for s in live], block_size)
        model.state_slots = [s["slot"] for s in live]
        logits = model.logits(model(torch.tensor(tokens), meta, caches)[rows])
        for s, n, row in zip(live, q_lens, logits):
            s["done"] += n
            if s["done"] == len(s["ids"]):
                token = int(row.argmax())
                s["out"].append(token)
                s["ids"].append(token)
    return [s["out"] for s in seqs]
