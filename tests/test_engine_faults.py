"""Whatever raises inside a step for one request ends that request with an error, not the engine."""
from __future__ import annotations

import pytest

from support.model_helpers import tiny_model_dir

from lmport.worker import sampling
from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=64))


def _run(engine, ids):
    final = {}
    while len(final) < len(ids):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _config():
    return GenerationConfig(max_new_tokens=6, ignore_eos=True)


def test_a_request_whose_sampling_raises_fails_alone(engine, monkeypatch):
    real = sampling.sample

    def sample(logits, seqs, masks=None):
        if any(s.request_id == "bad" for s in seqs):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, seqs, masks)

    monkeypatch.setattr(sampling, "sample", sample)
    ids = [engine.add_request([1, 2, 3], _config(), rid) for rid in ("good", "bad", "good2")]
    final = _run(engine, ids)
    assert final["bad"].finish_reason == "error" and "sampling failed" in final["bad"].error
    assert final["good"].finish_reason == "length" and len(final["good"].token_ids) == 6
    assert final["good2"].finish_reason == "length"
    assert engine.usage()["blocks_used"] == 0 and not engine.has_unfinished()


def test_a_request_whose_decoding_raises_fails_alone(engine, monkeypatch):
    real = engine.tokenizer.decode
    calls = []

    def decode(ids, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("broken decode")
        return real(ids, **kw)

    monkeypatch.setattr(engine.tokenizer, "decode", decode)
    ids = [engine.add_request([4, 5], _config(), rid) for rid in ("a", "b")]
    final = _run(engine, ids)
    reasons = sorted(o.finish_reason for o in final.values())
    assert reasons == ["error", "length"]
    assert "decoding failed: ValueError: broken decode" in [o.error for o in final.values() if o.error][0]
    assert engine.usage()["blocks_used"] == 0
