"""A quantized KV cache leaves the first generated token as the unquantized cache gives it.

A prompt's prefill attends to its own keys and values as computed, not through their quantized copies
(lmport.ops.attention), so on a prompt with no history the first token sees no quantization at all. On the
default model's chat prompts (benchmarks/kv_first_token.py's 20), INT4 changed it on 5 of 20 before, when
the prefill read itself back from the cache; the benchmark measures all 20. Each policy runs on the cpu
backend's own kernels (INT8, INT4: the compiled layer loop) or the reference ops (fp8).
"""
from __future__ import annotations

import functools

import pytest

import lmport
from lmport import EngineConfig, GenerationConfig
from lmport.models.loader import load_tokenizer
from benchmark_module import load_benchmark


# Of benchmarks/kv_first_token.py's 20 prompts, the 5 whose first token INT4 changed when a prefill read itself
# through the cache (3, 7, 14, 16, 18), and one it did not: the default run stays short.
FAST = (0, 3, 7, 14, 16, 18)


@functools.cache
def prompts() -> list[list[int]]:
    tok = load_tokenizer("smollm2")
    texts = [load_benchmark("kv_first_token").CHAT_PROMPTS[i] for i in FAST]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False) for t in texts]


@functools.cache
def first_tokens(policy) -> list[int]:
    pipe = lmport.pipeline("smollm2", backend_config=EngineConfig(device_type="cpu", quant_policy=policy,
                                                                  cache_max_entry_count=64))
    try:
        out = pipe.generate(prompts(), GenerationConfig(max_new_tokens=1, ignore_eos=True))
    finally:
        pipe.close()
    return [r.token_ids[0] for r in out]


# INT4, the policy that changed it, in the default run; INT8 and fp8 under `make test-all`.
@pytest.mark.parametrize("policy", [4, pytest.param(8, marks=pytest.mark.slow),
                                    pytest.param("fp8", marks=pytest.mark.slow)])
def test_quantized_cache_keeps_the_first_token(policy):
    assert len(prompts()) == len(FAST)
    assert first_tokens(policy) == first_tokens(0)
