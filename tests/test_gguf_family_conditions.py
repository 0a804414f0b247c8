"""The newer families' GGUF files made by llama.cpp's converter and llama-quantize, run by lmport's engine under the
conditions the float directories are tested in (tests/test_architectures.py, tests/test_deepseek_v3.py,
tests/test_qwen3_next.py, tests/test_qwen3_5.py), against transformers holding the same file's dequantized tensors
(slow).

Files: SmolLM3, GLM-4.5, DeepSeek-V3 and Qwen3-Next as tests/test_gguf_new_families.py makes them; gpt-oss, Llama 4
(text), Qwen3.5 and Qwen3.5-MoE as tests/support/llama_cpp_families.py does; each family's Q8_0 and Q4_K_M, and
gpt-oss's MXFP4_MOE. llama.cpp is found as tests/test_gguf_llama_cpp.py finds it; without it the tests are skipped,
saying so.

For each file, lmport (cpu, float32 compute, the weights kept quantized) and transformers' greedy tokens on five
prompts of 1 to 200 tokens, 24 new tokens each, every prompt identical. The five prompts are submitted together (one
batch), prefilled 40 tokens a step (chunks end inside blocks of 16 and of 64), with blocks of 16 and of 64 tokens:

- with prefix caching on, the 200-token prompt again once the others finished: its full blocks are found in the
  prefix cache (``prefix_cache_hit_blocks_device``). Qwen3-Next's and Qwen3.5's linear-attention layers keep a state
  the prefix cache does not store: the engine says prefix caching is off, has no cache, and the repeat is
  recomputed to the same tokens;
- in too few blocks for the five sequences (about 540 tokens): the scheduler preempts (``preemptions`` > 0) and the
  preempted sequences come back to the same tokens.
"""
from __future__ import annotations

import functools

import pytest

from support import greedy

pytestmark = pytest.mark.slow

FAMILIES = ("smollm3", "glm4-moe", "deepseek-v3", "qwen3-next", "qwen3.5", "qwen3.5-moe", "gpt-oss", "llama4")
# (family, file kind): each family's Q8_0 and Q4_K_M, and gpt-oss's MXFP4 experts
FILES = [(arch, kind) for arch in FAMILIES for kind in ("Q8_0", "Q4_K_M")] + [("gpt-oss", "MXFP4_MOE")]
HYBRID = {"qwen3-next", "qwen3.5", "qwen3.5-moe"}   # linear-attention layers beside full attention
LENGTHS = (1, 17, 70, 130, 200)
NEW_TOKENS = 24
CHUNK = 40   # prefill tokens a step
PREEMPTING_BLOCKS = {16: 20, 64: 6}   # 320 and 384 tokens, for five sequences of 538


def _ids(files):
    return [f"{arch}-{kind}" for arch, kind in files]


def family_files(arch: str):
    """The module that makes ``arch``'s files and its reference model (``gguf_file``, ``reference_model``)."""
    import test_gguf_new_families as new_families
    if arch in new_families.FAMILIES:
        return new_families
    from support import llama_cpp_families
    return llama_cpp_families


def prompts() -> list[list[int]]:
    return greedy.prompts(len(LENGTHS), seed=61, lengths=LENGTHS)


@functools.cache
def reference(arch: str, kind: str) -> tuple[list[int], ...]:
    """transformers' greedy tokens of the prompts on the file's dequantized tensors."""
    files = family_files(arch)
    model = files.reference_model(arch, files.gguf_file(arch, kind))
    return tuple(greedy.hf_greedy(model, prompts(), NEW_TOKENS))


def check(got: list[list[int]], want: list[list[int]]) -> None:
    same, diverged = greedy.agreement(got, want)
    assert same == len(want), diverged


def run(arch: str, kind: str, prompt_batches: list[list[list[int]]], **config):
    """Greedy tokens of each batch of prompts (a batch submitted together, the next once it finished) on one engine,
    and the engine and its usage once all finished."""
    import lmport
    from lmport import EngineConfig, GenerationConfig
    config = dict(device_type="cpu", dtype="float32", max_prefill_token_num=CHUNK) | config
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with lmport.pipeline(str(family_files(arch).gguf_file(arch, kind)), backend_config=EngineConfig(**config)) as pipe:
        tokens = [[r.token_ids for r in pipe.generate(batch, gen)] for batch in prompt_batches]
        usage = pipe.engine.usage()
        cache = pipe.engine.block_manager.cache
        pool = pipe.engine.scheduler.state_pool
        if arch in HYBRID:
            assert pool is not None and pool.num_free == pool.num_slots, "every state slot is free once all finished"
    assert usage["blocks_used"] == 0, "every block must be free once all requests finished"
    return tokens, usage, cache


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("arch", "kind"), FILES, ids=_ids(FILES))
def test_chunked_batched_and_prefix_cached(arch, kind, block_size, caplog):
    """The five prompts together in chunks, then the 200-token one again from the prefix cache (hybrids: refused)."""
    ps, want = prompts(), list(reference(arch, kind))
    with caplog.at_level("WARNING"):
        (first, (again,)), usage, cache = run(arch, kind, [ps, [ps[-1]]], block_size=block_size,
                                              cache_max_entry_count=4096 // block_size, enable_prefix_caching=True)
    assert usage["preemptions"] == 0
    if arch in HYBRID:
        assert cache is None
        assert any("prefix caching is off" in r.getMessage() and "linear-attention" in r.getMessage()
                   for r in caplog.records)
        assert usage["prefix_cache_hit_blocks_device"] == 0
    else:
        assert usage["prefix_cache_hit_blocks_device"] == LENGTHS[-1] // block_size
    check([*first, again], [*want, want[-1]])


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("arch", "kind"), FILES, ids=_ids(FILES))
def test_after_preemption(arch, kind, block_size):
    (tokens,), usage, _ = run(arch, kind, [prompts()], block_size=block_size,
                              cache_max_entry_count=PREEMPTING_BLOCKS[block_size])
    assert usage["preemptions"] > 0
    check(tokens, list(reference(arch, kind)))
