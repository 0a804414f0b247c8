"""peft LoRA adapters on the tiny test models, and transformers + peft references with them merged.

Adapters are made by peft itself (``get_peft_model`` with ``init_lora_weights=False``: random A and B,
not the identity a fresh adapter starts as) on q/k/v/o and gate/up/down, saved with ``save_pretrained``
into the test cache, so the engine reads exactly what peft writes.
"""
from __future__ import annotations

import functools
import os
import shutil

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(model_dir: str, rank: int, seed: int, targets: tuple[str, ...]):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False,
                        lora_dropout=0.0)
    return get_peft_model(base, config)


@functools.cache
def adapter_dir(model_dir: str, rank: int, seed: int, targets: tuple[str, ...] = tuple(TARGETS)) -> str:
    """A peft adapter directory for the model in ``model_dir`` (cached by model, rank, seed and targets)."""
    from lmport.models.loader import cache_root
    name = f"lora-{os.path.basename(model_dir)}-r{rank}-s{seed}-{'-'.join(t[:-5] for t in targets)}"
    target = cache_root() / "test-models" / name
    if not (target / "adapter_config.json").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        _peft_model(model_dir, rank, seed, targets).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


@functools.cache
def merged_model(model_dir: str, adapter: str):
    """transformers' model with the peft adapter at ``adapter`` loaded by peft and merged (float32, eval)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' generate(do_sample=False), one prompt at a time, never stopping early."""
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            out.append(gen[0, len(ids):].tolist())
    return out
