"""Sampling with a draft model keeps the target's own distribution (Leviathan et al. 2023, Chen et al. 2023).

A tiny random Llama (the target) is drafted by its own first layer (``tiny_draft_dir``): a real draft
distribution q, close to the target's p but not equal (their top-4 sets overlap only in part). Requests sample
four tokens at temperature 1 with top_k=4. The first comes from the prompt's own step; the draft proposes
the second and third (with the probabilities it drew them from), and they come out of the acceptance rule.
The joint distribution of the first three tokens is compared with transformers' own (the target's logits,
top-4, softmax) by a chi-square test.

Samples: 1,200 requests over the 64 cells of three top-4 draws (about 19 expected a cell; cells under 5 are
pooled, where the chi-square approximation holds); more would make the test slow (each request costs a few
full-vocabulary draws of both models). The seeds are fixed, so the test is deterministic. With the correct
rule the p-value must be above 0.001. The broken rule draws a rejected position's token from p itself (not
from norm(max(0, p - q))): tokens both models like are then drawn too often, which this many samples show
with a p-value under 1e-4.
"""
from __future__ import annotations

import pytest
import torch

import lmport
from lmport.config import EngineConfig, GenerationConfig
from lmport.speculative import acceptance
from support.model_helpers import hf_model, tiny_draft_dir, tiny_model_dir
from test_speculative_distribution import chi_square_p

REQUESTS = 1200
TOP_K = 4


def reference(model_dir: str, prompt: list[int]) -> dict[tuple[int, int, int], float]:
    """transformers' probabilities of the first three tokens after ``prompt`` (top-k, temperature 1)."""
    hf = hf_model(model_dir)

    def probs(ids):
        with torch.no_grad():
            top = hf(torch.tensor([ids])).logits[0, -1].float().topk(TOP_K)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    return {(t1, t2, t3): p1 * p2 * p3
            for t1, p1 in probs(prompt).items()
            for t2, p2 in probs(prompt + [t1]).items()
            for t3, p3 in probs(prompt + [t1, t2]).items()}


def sample_triples(model_dir: str, prompt: list[int]) -> tuple[list, dict]:
    spec = {"method": "draft", "model": tiny_draft_dir("llama"), "num_speculative_tokens": 2,
            "disable_by_batch_size": 128, "min_acceptance": 0.0, "pause_when_slower": False}
    cfg = EngineConfig(device_type="cpu", cache_max_entry_count=600, max_batch_size=128, speculative=spec)
    with lmport.pipeline(model_dir, backend_config=cfg) as pipe:
        engine, done = pipe.engine, {}
        for i in range(REQUESTS):
            engine.add_request(prompt, GenerationConfig(max_new_tokens=4, do_sample=True, temperature=1.0,
                                                        top_k=TOP_K, ignore_eos=True, random_seed=i))
        while engine.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        usage = engine.usage()
    assert len(done) == REQUESTS and all(len(t) == 4 for t in done.values())
    return [tuple(t[:3]) for t in done.values()], usage


@pytest.fixture(scope="module")
def setup():
    model_dir = tiny_model_dir("llama")
    prompt = torch.randint(3, 40000, (12,), generator=torch.Generator().manual_seed(31)).tolist()
    return model_dir, prompt, reference(model_dir, prompt)


@pytest.mark.slow   # some 10,000 full-vocabulary draws a run
def test_draft_sampling_matches_the_target_distribution(setup):
    model_dir, prompt, expected = setup
    triples, usage = sample_triples(model_dir, prompt)
    # Every request verified a draft proposal; proposals were both accepted and rejected.
    assert usage["spec_verifications"] >= REQUESTS
    assert 0 < usage["spec_accepted_tokens"] < usage["spec_proposed_tokens"]
    p_value = chi_square_p(triples, expected)
    print(f"{len(triples)} samples, acceptance {usage['spec_acceptance_rate']:.3f}, p-value {p_value:.3g}")
    assert p_value > 1e-3


@pytest.mark.slow
def test_a_broken_rejection_rule_fails_the_check(setup, monkeypatch):
    model_dir, prompt, expected = setup
    monkeypatch.setattr(acceptance, "residual", lambda p, q: p)   # draws a rejected position from p itself
    triples, _ = sample_triples(model_dir, prompt)
    p_value = chi_square_p(triples, expected)
    print(f"{len(triples)} samples, p-value {p_value:.3g} (broken rule)")
    assert p_value < 1e-4
