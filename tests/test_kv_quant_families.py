"""quant_policy=8 on each newer family's paged cache: the engine's greedy tokens equal transformers' forward over
the values lmport's int8 codes decode to.

A quantized cache changes what later tokens read, so transformers over its float cache is no reference beyond
the first token. The reference here is transformers' own model (generate: the whole prompt in one forward, then
one token a forward) with one change, an attention function (registered with transformers' AttentionInterface,
calling the model's own ``eager_attention_forward``) that reads keys and values as lmport's attention does
(docs/kv-quantization.md, "The step's own keys and values"):

- the tokens of the engine's current step attend to their own keys and values as computed;
- every earlier token is read through the cache: its row (one token, one KV head, head_dim values; for MLA the
  token's latent, kv_lora_rank normed values and the rotated rope part, one row) round-tripped through
  ``lmport.kv.quant.quantize`` / ``dequantize`` (8 bits, float32 scale and zero: a float32 cache).

The engine's steps are recorded from its scheduler (which tokens of which prompt each step computed), and the
reference's prompt forward splits its queries at the same places: a chunk reads the chunks before it quantized
and itself as computed, as a chunked prefill in the engine does; each decode token reads its own key and value
as computed and all before it quantized. For MLA (DeepSeek-V3) the earlier tokens' keys and values are rebuilt
from their round-tripped latents with the layer's ``kv_b_proj``, the latent taken from ``kv_a_layernorm``'s
output and the key's rope part. Recurrent layers (Qwen3-Next, Qwen3.5) keep their float state in both.

What differs between the two is float summation order only (and lmport's absorbed MLA projections), so a
quantization level could in principle round the other way on one element; the tokens are asserted identical.
Each run also checks that the cache holds uint8 codes, so a float cache cannot pass.

With the round trip left out of the reference (a float history), the tokens differ on SmolLM3, GLM-4.5, gpt-oss,
Llama 4 and DeepSeek-V3. On the hybrids (one full-attention layer in four) they do not, so there each generated
token's log-probability must also be the reference's within LOGPROB_ATOL: over the int8 history they agree within
5e-5, over a float history they are up to 7e-4 (Qwen3-Next) and 9e-4 (Qwen3.5) apart.
"""
from __future__ import annotations

import functools
import sys
from collections import defaultdict

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from lmport.kv import quant

NEW_TOKENS = 24
BLOCK = 16
CHUNK = 40          # prefill tokens a step: chunks end inside blocks of 16
LENGTHS = (1, 17, 70, 130)   # one token, one block and a bit, several blocks in chunks
VOCAB = 49152
ATTENTION = "lmport_int8_kv"
HYBRIDS = ("qwen3-next", "qwen3.5")
LOGPROB_ATOL = 2e-4
FAMILIES = ("smollm3", "glm4-moe", "gpt-oss", "llama4", "qwen3-next", "qwen3.5", "deepseek-v3")


def model_dir(family: str) -> str:
    if family == "qwen3-next":
        from support.qwen3_next_model import tiny_model_dir
        return tiny_model_dir()
    if family == "qwen3.5":
        from support.qwen3_5_model import tiny_model_dir
        return tiny_model_dir("dense")
    if family == "deepseek-v3":
        from test_deepseek_v3 import tiny_model_dir
        return tiny_model_dir("q-lora")
    from support.tiny_float_models import tiny_model_dir
    return tiny_model_dir(family)


def prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(8)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


# -- the reference ----------------------------------------------------------------------------------------------

def round_trip(x: torch.Tensor) -> torch.Tensor:
    """What a float32 INT8 cache gives back for ``x``, row by row over its last axis (lmport's own scheme)."""
    codes, qparams = quant.quantize(x, 8, torch.float32)
    return quant.dequantize(codes, qparams, 8, x.dtype)


# The prefill chunks of the prompt the reference is running (the engine's step sizes); set per prompt.
_chunks: list[int] = []


def _read_back(module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's key and value as read through the quantized cache."""
    if not hasattr(module, "kv_b_proj"):
        return round_trip(key), round_trip(value)
    # MLA: the cache holds [normed latent, rotated rope part] a token; rebuild K and V from its round trip.
    latent = torch.cat(module.kv_quant_latents, dim=1)          # [B, k, kv_lora_rank]
    assert latent.shape[1] == key.shape[2]
    nope, rope = module.qk_nope_head_dim, module.qk_rope_head_dim
    cached = round_trip(torch.cat([latent, key[:, 0, :, nope:]], dim=-1))
    c, k_rope = cached.split([module.kv_lora_rank, rope], dim=-1)
    b, k = c.shape[:2]
    kv = module.kv_b_proj(c).view(b, k, -1, nope + module.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([nope, module.v_head_dim], dim=-1)
    return torch.cat([k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1), v


def quantized_history_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's eager attention, its queries split at the engine's steps: each step's queries read the
    positions before the step through the quantized cache and the step's own as computed."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    q, k = query.shape[2], key.shape[2]
    if q == k and hasattr(module, "kv_b_proj"):   # a new prompt: drop the previous one's latents
        module.kv_quant_latents = module.kv_quant_latents[-1:]
    chunks = _chunks if q == k else [q]
    assert sum(chunks) == q, (chunks, q)
    key_q, value_q = _read_back(module, key, value)
    outs, start = [], 0
    for n in chunks:
        hist = k - q + start
        kk = torch.cat([key_q[:, :, :hist], key[:, :, hist:hist + n]], dim=2)
        vv = torch.cat([value_q[:, :, :hist], value[:, :, hist:hist + n]], dim=2)
        mask = None if attention_mask is None else attention_mask[:, :, start:start + n, :hist + n]
        outs.append(eager(module, query[:, :, start:start + n], kk, vv, mask, **kwargs)[0])
        start += n
    return torch.cat(outs, dim=1), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(ATTENTION, quantized_history_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


@functools.cache
def reference_model(family: str):
    import transformers
    _register()
    path = model_dir(family)
    cls = transformers.Qwen3_5ForConditionalGeneration if family == "qwen3.5" else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation=ATTENTION).eval()
    for layer in model.modules():
        if hasattr(layer, "kv_b_proj"):   # MLA: keep each token's normed latent as the cache would
            layer.kv_quant_latents = []
            layer.kv_a_layernorm.register_forward_hook(
                lambda _m, _args, out, layer=layer: layer.kv_quant_latents.append(out.detach()))
    return model


def reference(family: str, prompt: list[int], chunks: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens over the quantized history, the prompt's forward split at ``chunks``, and each
    token's log-probability."""
    global _chunks
    _chunks = chunks
    with torch.inference_mode():
        got = reference_model(family).generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                               min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                               output_logits=True, return_dict_in_generate=True)
    tokens = got.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(got.logits, tokens)]
    return tokens, logprobs


# -- the engine -------------------------------------------------------------------------------------------------

def run(family: str, prompt_ids: list[list[int]], **config) -> tuple[list[list[int]], list[list[float]],
                                                                     list[list[int]]]:
    """The engine's greedy tokens of the prompts, submitted together, their log-probabilities, and each prompt's
    prefill step sizes."""
    config = dict(device_type="cpu", dtype="float32", quant_policy=8, block_size=BLOCK,
                  max_prefill_token_num=CHUNK, cache_max_entry_count=64) | config
    steps: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
    with lmport.pipeline(model_dir(family), backend_config=EngineConfig(**config)) as pipe:
        scheduler = pipe.engine.scheduler
        schedule = scheduler.schedule

        def recorded():
            batch = schedule()
            for seq, n in zip(batch.seqs, batch.num_new):
                steps[tuple(seq.prompt_ids)].append((seq.num_computed, n))
            return batch

        scheduler.schedule = recorded
        out = pipe.generate(prompt_ids, GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))
        paged = [c for c in pipe.engine.caches if c.kind in ("kv", "latent")]
        assert paged and all(c.k.dtype == torch.uint8 and c.k_qparams is not None for c in paged)
        assert all(c.v is None or c.v.dtype == torch.uint8 for c in paged)
        usage = pipe.engine.usage()
    assert usage["preemptions"] == 0
    chunks = []
    for ids in prompt_ids:
        done = 0
        for start, n in steps[tuple(ids)]:   # contiguous steps: nothing recomputed
            assert start == done
            done += n
        assert done == len(ids) + NEW_TOKENS - 1
        prefill = [n for start, n in steps[tuple(ids)] if start < len(ids)]
        assert sum(prefill) == len(ids), "a step mixing prompt and generated tokens"
        chunks.append(prefill)
    logprobs = [[r.logprobs[i][t] for i, t in enumerate(r.token_ids)] for r in out]
    return [r.token_ids for r in out], logprobs, chunks


def check(family: str, lengths: tuple[int, ...]) -> None:
    ps = prompts(lengths)
    got, logprobs, chunks = run(family, ps)
    assert any(len(c) > 1 for c in chunks), "no prompt was prefilled in chunks"
    want = [reference(family, p, c) for p, c in zip(ps, chunks)]
    assert got == [tokens for tokens, _ in want]
    if family in HYBRIDS:   # their tokens alone do not tell the int8 history from a float one (see the docstring)
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor([lp for _, lp in want]), rtol=0,
                                   atol=LOGPROB_ATOL)


def test_smollm3_int8_cache_matches_transformers_over_the_dequantized_history():
    """The default run's representative: a one-block prompt and a 70-token one in chunks of 40, batched."""
    check("smollm3", (17, 70))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_cache_matches_transformers_over_the_dequantized_history(family):
    check(family, LENGTHS)
