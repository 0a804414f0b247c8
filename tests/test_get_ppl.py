"""Pipeline.get_ppl: the engine's paged forward in chunks under a logits budget, equal to transformers' perplexity."""
from __future__ import annotations

import functools
import math
from unittest import mock

import pytest
import torch

import lmport
from lmport.worker import scoring
from lmport.backends.cpu import CpuBackend
from lmport.config import EngineConfig
from lmport.engine.engine import RequestError
from support.model_helpers import hf_model

FREE = 3 << 30   # free memory the engine sees once its weights are loaded: the same plan on every machine
# float32, as transformers computes it
CONFIG = EngineConfig(device_type="cpu", cache_max_entry_count=0.05, weight_format="dequantize")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps keys and values in fixed-size blocks, so no memory is lost to padding; a block "
    "table maps each sequence's logical blocks to physical ones.",
    "Perplexity is the exponential of the mean negative log-likelihood.",
]


@functools.cache
def smollm2_pipeline():
    """The default model, loaded once for this file and test_memory_plan.py, planned with FREE bytes free."""
    with mock.patch.object(CpuBackend, "memory_info", lambda self: (FREE, FREE)):
        return lmport.pipeline("smollm2", CONFIG)


@functools.cache
def inputs() -> tuple[tuple[int, ...], ...]:
    tok = smollm2_pipeline().tokenizer
    return tuple(tuple(tok.encode(t)) for t in TEXTS)


def hf_ppl(ids) -> float:
    """transformers' loss-based perplexity: exp of the mean shifted cross-entropy."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        return math.exp(hf_model("smollm2")(x, labels=x).loss.item())


@pytest.fixture
def logits_shapes(monkeypatch):
    """Records the shape of every logits tensor the engine computes."""
    model = smollm2_pipeline().engine.model
    shapes, logits = [], model.logits

    def spy(hidden):
        out = logits(hidden)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(model, "logits", spy)
    return shapes


def test_default_budget_is_2gib_of_float32_logits():
    assert scoring.logits_chunk_tokens(49152) == 2 * 2**30 // (49152 * 4) == 10922
    with pytest.raises(ValueError, match="less than one position"):
        scoring.logits_chunk_tokens(49152, 49152 * 4 - 1)


def test_matches_transformers_in_one_chunk(logits_shapes):
    pipe = smollm2_pipeline()
    got = pipe.get_ppl([list(i) for i in inputs()])
    want = [hf_ppl(i) for i in inputs()]
    assert got == pytest.approx(want, rel=1e-3)
    assert [s[0] for s in logits_shapes] == [len(i) - 1 for i in inputs()]   # one chunk each
    assert pipe.engine.block_manager.num_free == pipe.engine.block_manager.num_blocks


def test_matches_transformers_over_several_chunks(logits_shapes):
    pipe = smollm2_pipeline()
    vocab = pipe.engine.model_config.vocab_size
    budget = vocab * 4 * 7                      # 7 positions a chunk
    longest = max(inputs(), key=len)
    assert len(longest) > 3 * 7
    got = pipe.get_ppl([list(i) for i in inputs()], logits_budget_bytes=budget)
    assert got == pytest.approx([hf_ppl(i) for i in inputs()], rel=1e-3)
    assert max(rows for rows, _ in logits_shapes) == 7
    assert all(rows * cols * 4 <= budget for rows, cols in logits_shapes)
    assert len(logits_shapes) == sum(-(-(len(i) - 1) // 7) for i in inputs())
    assert pipe.engine.block_manager.num_free == pipe.engine.block_manager.num_blocks


def test_blocks_are_freed_when_a_chunk_fails(monkeypatch):
    pipe = smollm2_pipeline()
    vocab = pipe.engine.model_config.vocab_size

    def fail(hidden):
        raise RuntimeError("injected")

    monkeypatch.setattr(pipe.engine.model, "logits", fail)
    with pytest.raises(RuntimeError, match="injected"):
        pipe.get_ppl([list(max(inputs(), key=len))], logits_budget_bytes=vocab * 4 * 7)
    assert pipe.engine.block_manager.num_free == pipe.engine.block_manager.num_blocks


@pytest.mark.parametrize("ids, match", [([5], "at least 2"), ([5, -1], r"in \[0, 49152\)"),
                                        ([5, 49152], r"in \[0, 49152\)")])
def test_bad_inputs(ids, match):
    with pytest.raises(RequestError, match=match):
        smollm2_pipeline().get_ppl([ids])


def test_longer_than_session_len():
    pipe = smollm2_pipeline()
    with pytest.raises(RequestError, match="exceed session_len"):
        pipe.get_ppl([[1] * (pipe.engine.session_len + 1)])
