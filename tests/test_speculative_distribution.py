"""Sampling with speculation keeps the model's own distribution (the rejection rule of Leviathan et al. 2023).

A tiny random Llama samples at temperature 1 with top_k=4. Its prompt holds "a b c d x" and ends with
"a b", and a logit bias makes c, d and x likely: whenever the first token is c, the n-gram lookup
proposes "d x" and the engine verifies it, so the second and third tokens come out of the acceptance
rule. Their joint distribution among those requests is compared with transformers' own (its logits,
the same bias, top-4, softmax) by a chi-square test over the pairs.

Samples: 600 requests, about 40% of which start with c (about 230 verified pairs: each request costs a
few full-vocabulary draws, so more would make the test slow); pairs are pooled into cells of at least 5
expected counts, where the chi-square approximation holds. The seeds are fixed, so the test is
deterministic. With the correct rule the p-value must be above 0.001; a rule that draws a rejected
position's token from p itself (not from p without the proposed token) gives d the share p(d)(2 - p(d))
instead of p(d), which this many samples show with a p-value under 1e-4.
"""
from __future__ import annotations

import pytest
import torch

import lmport
from lmport.config import EngineConfig, GenerationConfig
from lmport.speculative import acceptance
from support.model_helpers import hf_model, tiny_model_dir

REQUESTS = 1200
TOP_K = 4
MIN_EXPECTED = 5


def prompt_and_tokens():
    g = torch.Generator().manual_seed(21)
    head, a, b, c, d, x, mid = (torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 1, 1, 1, 1, 1, 6))
    return head + a + b + c + d + x + mid + a + b, c[0], d[0], x[0]


def reference(model_dir: str, prompt: list[int], bias: dict[int, float], first: int):
    """transformers' probabilities of (second, third) after ``prompt + [first]``, with the bias and top-k."""
    hf = hf_model(model_dir)

    def probs(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        for t, v in bias.items():
            logits[t] += v
        top = logits.topk(TOP_K)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    second = probs(prompt + [first])
    return {(t2, t3): p2 * p3 for t2, p2 in second.items() for t3, p3 in probs(prompt + [first, t2]).items()}


def sample_pairs(model_dir: str, prompt: list[int], bias: dict[int, float], first: int) -> tuple[list, dict]:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 2,
            "disable_by_batch_size": 128, "min_acceptance": 0.0, "pause_when_slower": False}
    cfg = EngineConfig(device_type="cpu", cache_max_entry_count=400, max_batch_size=128, speculative=spec)
    with lmport.pipeline(model_dir, backend_config=cfg) as pipe:
        engine, done = pipe.engine, {}
        for i in range(REQUESTS):
            engine.add_request(prompt, GenerationConfig(max_new_tokens=3, do_sample=True, temperature=1.0, top_k=TOP_K,
                                                        logit_bias=bias, ignore_eos=True, random_seed=i))
        while engine.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        usage = engine.usage()
    assert len(done) == REQUESTS and all(len(t) == 3 for t in done.values())
    return [tuple(t[1:3]) for t in done.values() if t[0] == first], usage


def chi_square_p(observed: list, expected: dict) -> float:
    n = len(observed)
    counts = {cell: 0 for cell in expected}
    for pair in observed:
        counts[pair] += 1    # a pair outside the model's top-k would raise here: it cannot be drawn
    cells, rest_o, rest_e = [], 0, 0.0
    for cell, p in expected.items():
        if p * n >= MIN_EXPECTED:
            cells.append((counts[cell], p * n))
        else:
            rest_o, rest_e = rest_o + counts[cell], rest_e + p * n
    if rest_e:
        cells.append((rest_o, rest_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def setup():
    model_dir = tiny_model_dir("llama")
    prompt, c, d, x = prompt_and_tokens()
    bias = {c: 3.0, d: 3.0, x: 3.0}
    return model_dir, prompt, bias, c, reference(model_dir, prompt, bias, c), d


@pytest.mark.slow   # some 1,800 full-vocabulary draws a run
def test_speculative_sampling_matches_the_model_distribution(setup):
    model_dir, prompt, bias, c, expected, _ = setup
    pairs, usage = sample_pairs(model_dir, prompt, bias, c)
    assert len(pairs) > 150
    assert usage["spec_verifications"] >= len(pairs)
    assert 0 < usage["spec_accepted_tokens"] < usage["spec_proposed_tokens"]   # accepted and rejected alike
    p_value = chi_square_p(pairs, expected)
    print(f"{len(pairs)} pairs, p-value {p_value:.3g}")
    assert p_value > 1e-3


@pytest.mark.slow
def test_a_broken_rejection_rule_fails_the_check(setup, monkeypatch):
    model_dir, prompt, bias, c, expected, d = setup
    monkeypatch.setattr(acceptance, "residual", lambda p, q: p)   # draws a rejected position from p itself
    pairs, _ = sample_pairs(model_dir, prompt, bias, c)
    p_value = chi_square_p(pairs, expected)
    print(f"{len(pairs)} pairs, p-value {p_value:.3g} (broken rule)")
    assert p_value < 1e-4
