"""Greedy tokens from lmport and from transformers on the same GGUF file, and the comparison."""
from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def reference_model(path: str, model_type: str | None = None):
    """transformers' float32 model of a GGUF: ``from_pretrained(dir, gguf_file=name)`` (which dequantizes
    every tensor with gguf's reference dequantizer). For Mixtral (architecture "llama" with experts, whose
    experts transformers' GGUF loader does not map) the Mixtral model of the file's metadata holding the
    file's dequantized tensors (support.gguf_files.hf_state_dict_from_gguf)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    p = Path(path)
    if model_type == "mixtral":
        from transformers import MixtralConfig

        from support.gguf_files import hf_state_dict_from_gguf
        meta = AutoConfig.from_pretrained(p.parent, gguf_file=p.name).to_dict()
        experts = _field(p, "llama.expert_count"), _field(p, "llama.expert_used_count")
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "rope_parameters")
        cfg = MixtralConfig(**{k: meta[k] for k in keep if k in meta}, num_local_experts=experts[0],
                            num_experts_per_tok=experts[1], sliding_window=None)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(hf_state_dict_from_gguf(cfg, p), strict=True)
        return model.eval()
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()


def _field(path: Path, key: str):
    from support.gguf_files import reader
    return reader(path).fields[key].contents()


def prompts(count: int, seed: int = 17, lengths=(1, 7, 33, 90)) -> list[list[int]]:
    """``count`` prompts of random token ids (3..49151), lengths cycling through ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]


def hf_greedy(model, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Argmax decoding with transformers' forward (KV cache), never stopping at an end-of-sequence token."""
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            past, x, got = None, torch.tensor([ids]), []
            for _ in range(new_tokens):
                r = model(x, past_key_values=past, use_cache=True)
                past = r.past_key_values
                token = int(r.logits[0, -1].argmax())
                got.append(token)
                x = torch.tensor([[token]])
            out.append(got)
    return out


def lmport_greedy(pipe, prompt_ids: list[list[int]], new_tokens: int, alone: bool = False) -> list[list[int]]:
    """Argmax decoding by lmport: the prompts together (a step's rows are every prompt's), or ``alone``,
    one after another (one row a decode step: the kernels' single-stream path)."""
    from lmport import GenerationConfig
    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    if alone:
        return [pipe.generate([ids], gen)[0].token_ids for ids in prompt_ids]
    return [r.token_ids for r in pipe.generate(prompt_ids, gen)]


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, list[str]]:
    """(identical sequences, a line for each one that diverged: the prompt index and the first differing step)."""
    diverged = [f"prompt {i} at token {next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)} "
                f"(lmport {g}, transformers {w})" for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return len(got) - len(diverged), diverged


def check_file(pipe, path: Path, prompt_ids: list[list[int]], want: list[list[int]], new_tokens: int,
               held_bound: float | None = 1.1) -> None:
    """lmport's greedy tokens over ``pipe`` (a pipeline of the GGUF file ``path``), the prompts together and each
    alone, against ``want``: at most one prompt diverges either way; and the weight bytes lmport holds at most
    ``held_bound`` x the file's tensor bytes (None: not checked)."""
    from support.gguf_files import tensor_bytes
    got = {mode: lmport_greedy(pipe, prompt_ids, new_tokens, alone=mode == "alone") for mode in ("batched", "alone")}
    held, file_bytes = pipe.engine.weight_bytes, tensor_bytes(path)
    print(f"\n{path.name}: lmport {held:,} B, file tensors {file_bytes:,} B ({held / file_bytes:.3f}x)")
    for mode, tokens in got.items():
        same, diverged = agreement(tokens, want)
        print(f"  {mode}: identical {same}/{len(prompt_ids)}; diverged: {diverged}")
        assert same >= len(prompt_ids) - 1, (mode, diverged)
    assert held_bound is None or held <= held_bound * file_bytes, (held, file_bytes)
