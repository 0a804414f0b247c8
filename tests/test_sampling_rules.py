"""The sampler's rules on small logits, exactly: which tokens top-k, top-p and min-p keep and with what
probability, temperature before them, and the penalties' signs. Through the engine's own path,
``sampling_probs(adjusted_logits(...))`` (lmport.worker.sampling); each rule alone is compared with transformers'
logits processor for it.

Where lmport chooses differently from transformers, the documented choice is tested (docs/engine.md,
"Sampling"): top-p and min-p are measured on the whole vocabulary's probabilities, not on what top-k left.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from lmport.config import GenerationConfig
from lmport.worker.sampling import adjusted_logits, sampling_probs
from lmport.sched.sequence import Sequence


def seq(prompt=(0,), output=(), **cfg) -> Sequence:
    s = Sequence("s", list(prompt), GenerationConfig(do_sample=True, **cfg), generator=torch.Generator())
    s.output_ids = list(output)
    return s


def probs(logits, s: Sequence | None = None, **cfg) -> torch.Tensor:
    """The distribution a token of ``s`` (or of a request with ``cfg``) is drawn from, for one row of logits."""
    s = s or seq(**cfg)
    return sampling_probs(adjusted_logits(torch.as_tensor(logits, dtype=torch.float32)[None], [s]), [s])[0]


def kept(logits, **cfg) -> set[int]:
    return set(probs(logits, **cfg).nonzero()[:, 0].tolist())


def log_probs(*p: float) -> list[float]:
    return [math.log(x) for x in p]


# -- each rule alone, against transformers --------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,warper", [
    ("top_k", 3, TopKLogitsWarper), ("top_k", 9, TopKLogitsWarper),
    ("top_p", 0.3, TopPLogitsWarper), ("top_p", 0.7, TopPLogitsWarper), ("top_p", 0.95, TopPLogitsWarper),
    ("min_p", 0.05, MinPLogitsWarper), ("min_p", 0.3, MinPLogitsWarper),
    ("temperature", 0.5, TemperatureLogitsWarper), ("temperature", 1.7, TemperatureLogitsWarper),
])
def test_each_rule_alone_equals_transformers(field, value, warper):
    logits = torch.randn(200, 12, generator=torch.Generator().manual_seed(0)) * 2   # no ties, no boundary cases
    seqs = [seq(**{field: value}) for _ in logits]
    got = sampling_probs(adjusted_logits(logits, seqs), seqs)
    want = warper(value)(None, logits.clone()).softmax(-1)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers_over_prompt_and_output(penalty):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 12, generator=g) * 2     # positive and negative logits
    ids = torch.randint(0, 12, (50, 6), generator=g)  # 3 prompt and 3 output tokens a row, repeats included
    seqs = [seq(row[:3].tolist(), row[3:].tolist(), repetition_penalty=penalty) for row in ids]
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.allclose(adjusted_logits(logits, seqs), want)


@pytest.mark.parametrize("field,value,warper", [("top_p", 0.6, TopPLogitsWarper), ("min_p", 0.2, MinPLogitsWarper)])
def test_temperature_comes_before_top_p_and_min_p(field, value, warper):
    logits = torch.randn(200, 12, generator=torch.Generator().manual_seed(2)) * 2
    seqs = [seq(temperature=0.4, **{field: value}) for _ in logits]
    got = sampling_probs(adjusted_logits(logits, seqs), seqs)
    want = warper(value)(None, TemperatureLogitsWarper(0.4)(None, logits.clone())).softmax(-1)
    assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, atol=1e-6)
    at_1 = sampling_probs(logits, [seq(**{field: value}) for _ in logits])
    assert not torch.equal(got > 0, at_1 > 0)   # the temperature did change what the rule keeps


# -- exact cases ----------------------------------------------------------------------------------------------------

def test_top_k_keeps_the_k_most_likely():
    logits = [1.0, 3.0, 2.0, 0.5, 2.5]
    assert kept(logits, top_k=2) == {1, 4}
    assert torch.allclose(probs(logits, top_k=2)[[1, 4]], torch.tensor([3.0, 2.5]).softmax(-1))
    assert kept(logits, top_k=0) == kept(logits, top_k=5) == set(range(5))   # 0: off


def test_top_k_among_ties_keeps_only_tied_tokens():
    # Which of tied tokens are kept is not specified (transformers keeps all of them); never a less likely one.
    got = kept([1.0, 2.0, 2.0, 2.0, 0.0], top_k=2)
    assert 2 <= len(got) and got <= {1, 2, 3}


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert kept(logits, top_p=0.49) == {0}
    assert kept(logits, top_p=0.79) == {0, 1}
    assert kept(logits, top_p=0.81) == {0, 1, 2}
    assert kept(logits, top_p=1.0) == {0, 1, 2, 3}
    assert torch.allclose(probs(logits, top_p=0.79), torch.tensor([0.625, 0.375, 0.0, 0.0]))   # renormalised
    assert kept([-5.0, 10.0, -5.0], top_p=1e-6) == {1}                                         # at least one


@pytest.mark.parametrize("top_p,count", [(0.125, 1), (0.25, 2), (0.375, 3), (0.5, 4), (0.875, 7), (0.9, 8)])
def test_top_p_over_tied_tokens_counts_exact_mass(top_p, count):
    """Eight equally likely tokens (1/8 each, exact in float32): a mass of exactly p is enough."""
    assert len(kept([0.0] * 8, top_p=top_p)) == count


def test_min_p_is_relative_to_the_most_likely_token():
    logits = [2.0, 1.0, 0.0, -1.0]   # probabilities 0.64, 0.24, 0.09, 0.03; relative to the first 1, e^-1, e^-2, e^-3
    assert kept(logits, min_p=0.3) == {0, 1}      # e^-1 = 0.37 >= 0.3 although 0.24 < 0.3
    assert kept(logits, min_p=0.1) == {0, 1, 2}   # e^-2 = 0.135 >= 0.1 although 0.09 < 0.1
    assert kept(logits, min_p=0.4) == {0}
    assert torch.allclose(probs(logits, min_p=0.3)[:2], torch.tensor([2.0, 1.0]).softmax(-1))


def test_top_p_is_over_what_top_k_keeps_renormalised():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # top-k 2 leaves 4/7 and 3/7: 4/7 reaches 0.5 alone (over the whole vocabulary, 0.4 would not).
    assert kept(logits, top_k=2, top_p=0.5) == {0}
    assert kept(logits, top_k=3, top_p=0.65) == {0, 1}   # 4/9 < 0.65 <= 7/9
    assert kept(logits, top_k=3, min_p=0.6) == {0, 1}   # 0.3 / 0.4 = 0.75 >= 0.6 > 0.2 / 0.4
    assert kept(logits, top_p=0.95, min_p=0.4) == {0, 1, 2}
    assert kept(logits, top_k=3, top_p=0.95, min_p=0.6) == {0, 1}


@pytest.mark.parametrize("top_k,top_p,min_p,scale", [
    (3, 0.5, 0.0, 3.0), (5, 0.8, 0.0, 3.0), (4, 0.9, 0.1, 3.0), (9, 0.6, 0.05, 3.0),
    (1400, 0.9, 0.0, 0.05),   # flat rows: top-p needs more tokens than the partial sort's candidates
])
def test_top_k_top_p_and_min_p_together_equal_transformers_chain(top_k, top_p, min_p, scale):
    vocab = 1500
    logits = torch.randn(100, vocab, generator=torch.Generator().manual_seed(3)) * scale
    seqs = [seq(top_k=top_k, top_p=top_p, min_p=min_p) for _ in logits]
    got = sampling_probs(adjusted_logits(logits, seqs), seqs)
    want = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits.clone()))
    if min_p:
        want = MinPLogitsWarper(min_p)(None, want)
    want = want.softmax(-1)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[-2.0, 1.0, 0.5, -1.0, 3.0]])
    s = seq([0, 0], [1], repetition_penalty=2.0)   # seen: 0 (prompt, twice) and 1 (output): each once
    assert torch.equal(adjusted_logits(logits, [s]), torch.tensor([[-4.0, 0.5, 0.5, -1.0, 3.0]]))
    s = seq([0, 0], [1], repetition_penalty=0.5)   # under 1: seen tokens made more likely
    assert torch.equal(adjusted_logits(logits, [s]), torch.tensor([[-1.0, 2.0, 0.5, -1.0, 3.0]]))


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.tensor([[1.0, -2.0, 0.5, 0.0, 2.0]])
    s = seq([0, 2], [1, 1, 3], presence_penalty=0.5, frequency_penalty=0.25)
    # 1: -2 - 2 * 0.25 - 0.5; 3: 0 - 0.25 - 0.5; the prompt's 0 and 2 are not counted.
    assert torch.allclose(adjusted_logits(logits, [s]), torch.tensor([[1.0, -3.0, 0.5, -0.75, 2.0]]))
    s = seq([0, 2], [1, 1, 3], presence_penalty=-1.0, frequency_penalty=-0.5)   # negative: made more likely
    assert torch.allclose(adjusted_logits(logits, [s]), torch.tensor([[1.0, 0.0, 0.5, 1.5, 2.0]]))


def test_penalties_come_before_the_filters():
    """top-k chooses among the penalised logits: a seen token can fall out of it."""
    logits = [3.0, 2.9, 2.8, 0.0]
    assert kept(logits, s=seq([0], repetition_penalty=2.0, top_k=2)) == {1, 2}
    assert kept(logits, s=seq([5], [0], presence_penalty=1.0, top_k=2)) == {1, 2}


def test_each_row_of_a_mixed_batch_keeps_its_own_rules():
    """The batch is filtered to the widest row's candidates; each row still keeps only what its own request
    asks for, as when it is alone."""
    configs = [{"top_k": 2}, {"top_k": 5}, {"top_k": 3, "top_p": 0.6}, {"top_p": 0.5}, {"min_p": 0.2},
               {"top_k": 4, "min_p": 0.1}, {"temperature": 0.7, "top_k": 3}, {}, {"repetition_penalty": 1.5}]
    logits = torch.randn(len(configs), 10, generator=torch.Generator().manual_seed(3)) * 2
    seqs = [seq([1, 2], [3], **cfg) for cfg in configs]
    batch = sampling_probs(adjusted_logits(logits, seqs), seqs)
    for i, s in enumerate(seqs):
        assert torch.allclose(batch[i], probs(logits[i], s), atol=1e-6), configs[i]
    assert [int((row > 0).sum()) for row in batch[:2]] == [2, 5]
