"""The engine against transformers: greedy tokens identical, logits within tolerance."""
from __future__ import annotations

import functools

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from support.model_helpers import TINY_ARCHS, hf_greedy, hf_model, tiny_model_dir

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time in a land far away, there lived a princess who",
    "1, 2, 3, 4,",
    "Explain paged attention in one sentence:",
    "The quick brown fox",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\n\nx = np.",
    "Roses are red,",
    "In 1492,",
    "The three primary colors are",
    "Translate to French: Good morning, how are you today? It is a beautiful day and",
    "SELECT name FROM users WHERE",
    "My favourite food is",
    "A",
]
NEW_TOKENS = 12
# The default model's runs here take eight of them, 1 to 19 tokens (16 and 19 end on and cross a 16-token block,
# 15 crosses one while decoding): identity does not depend on how many, and transformers' reference decodes each
# prompt alone, the file's largest cost. test_quantized_model.py takes all sixteen.
PARITY = [0, 2, 3, 4, 7, 8, 12, 15]


@functools.cache
def prompt_ids() -> list[list[int]]:
    from lmport.models.loader import load_tokenizer
    tok = load_tokenizer("smollm2")
    return [tok.encode(p) for p in PROMPTS]


@functools.cache
def parity_ids() -> list[list[int]]:
    return [prompt_ids()[i] for i in PARITY]


@functools.cache
def reference_tokens() -> list[list[int]]:
    return hf_greedy("smollm2", parity_ids(), NEW_TOKENS)


def run_engine(model, ids, max_new_tokens, **config):
    # The default model's GGUF dequantized to float32 (as transformers loads it), so tokens must be
    # identical; its quantized path is held to the reference in test_quantized_model.py.
    config.setdefault("weight_format", "dequantize")
    with lmport.pipeline(model, backend_config=EngineConfig(device_type="cpu", **config)) as pipe:
        responses = pipe.generate(ids, GenerationConfig(max_new_tokens=max_new_tokens))
        usage = pipe.engine.usage()
    assert usage["blocks_used"] == 0, "every block must be free once all requests finished"
    return [r.token_ids for r in responses], usage


# The default run covers block sizes 16, 1 and 64, with float16 K and V on the 64-token blocks (one engine fewer);
# the other two combinations run with the slow tests.
@pytest.mark.parametrize("block_size,blocks,kv_cache_dtype", [
    (16, 200, "auto"), (1, 1200, "auto"), (64, 40, "float16"),
    pytest.param(64, 40, "auto", marks=pytest.mark.slow), pytest.param(16, 200, "float16", marks=pytest.mark.slow)])
def test_default_model_greedy_matches_transformers(block_size, blocks, kv_cache_dtype):
    """Tokens identical, also with K and V kept in float16 (transformers keeps them in float32)."""
    tokens, usage = run_engine("smollm2", parity_ids(), NEW_TOKENS, block_size=block_size,
                               cache_max_entry_count=blocks, kv_cache_dtype=kv_cache_dtype)
    assert tokens == reference_tokens()


def test_default_model_greedy_matches_transformers_under_preemption():
    # 10 blocks of 16 tokens cannot hold 8 sequences of 13-31 tokens (14 blocks): the scheduler must preempt.
    tokens, usage = run_engine("smollm2", parity_ids(), NEW_TOKENS, block_size=16, cache_max_entry_count=10,
                               max_prefill_token_num=64)
    assert usage["preemptions"] > 0
    assert tokens == reference_tokens()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_greedy_and_logits(arch):
    model_dir = tiny_model_dir(arch)
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 5, 17, 33, 64, 200)]
    # 320 prompt tokens: the first step's linears run as a prefill GEMM, not the small-batch kernel
    want = hf_greedy(model_dir, ids, 8)
    got, usage = run_engine(model_dir, ids, 8, block_size=16, cache_max_entry_count=64)
    assert got == want

    # Logits of the whole prompt, in chunks through the paged cache, against transformers' forward.
    pipe = lmport.pipeline(model_dir, backend_config=EngineConfig(device_type="cpu", cache_max_entry_count=64))
    engine = pipe.engine
    with torch.inference_mode():
        ref = hf_model(model_dir)(torch.tensor([ids[-1]])).logits[0]
    seq_id = engine.add_request(ids[-1], GenerationConfig(max_new_tokens=1))
    seq = engine.seqs[seq_id]
    engine.scheduler.token_budget = 24  # three chunks: 24 + 24 + 16
    logits = []
    while seq.num_uncomputed:
        batch = engine.scheduler.schedule()
        kv = [s.num_computed + n for s, n in zip(batch.seqs, batch.num_new)]
        meta = lmport.ops.build_attention_metadata(batch.num_new, kv, [s.block_table for s in batch.seqs],
                                                   engine.layout.block_size)
        chunk = seq.token_ids[seq.num_computed:seq.num_computed + batch.num_new[0]]
        hidden = engine.model(torch.tensor(chunk), meta, engine.caches)
        logits.append(engine.model.logits(hidden))
        seq.num_computed += batch.num_new[0]
    # float32 both sides; differences come from summation order only.
    torch.testing.assert_close(torch.cat(logits), ref, atol=2e-4, rtol=1e-4)
    pipe.close()


@pytest.mark.parametrize("rows", [[0], [3], [1, 2, 3], [0, 1, 2, 3, 4], [0, 2], [1, 3, 4]])
def test_a_steps_logits_rows_are_those_rows_and_consecutive_ones_a_view(rows):
    from lmport.worker.sampling import rows_of
    x = torch.arange(20.0).view(5, 4)
    picked = rows_of(x, rows)
    torch.testing.assert_close(picked, x[rows], rtol=0, atol=0)
    assert (picked.data_ptr() == x[rows[0]].data_ptr()) == (rows[-1] - rows[0] == len(rows) - 1)
