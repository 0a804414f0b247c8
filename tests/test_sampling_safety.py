"""The sampler never raises on a valid GenerationConfig, whatever the logits; the engine contains what does."""
from __future__ import annotations

import math

import pytest
import torch

from lmport.config import GenerationConfig
from lmport.sampling import TEMPERATURE_FLOOR, sample
from lmport.sequence import Sequence

VOCAB = 50


def _seq(i=0, **cfg) -> Sequence:
    gen = GenerationConfig(do_sample=True, **cfg)
    g = torch.Generator().manual_seed(i)
    return Sequence(f"s{i}", [1, 2, 3], gen, generator=g)


@pytest.mark.parametrize("cfg", [
    dict(temperature=1e-300), dict(temperature=TEMPERATURE_FLOOR / 2), dict(temperature=2.0),
    dict(top_k=10**23), dict(repetition_penalty=0.01), dict(repetition_penalty=100.0),
    dict(min_p=0.999999), dict(top_p=1e-300), dict(temperature=1e-4, top_k=3, top_p=0.5, min_p=0.5),
])
@pytest.mark.parametrize("logits", ["normal", "nan row", "all -inf", "huge", "one finite"])
def test_sample_is_safe(cfg, logits):
    x = torch.randn(2, VOCAB) * 5
    if logits == "nan row":
        x[0] = float("nan")
    elif logits == "all -inf":
        x[0] = float("-inf")
    elif logits == "huge":
        x[0] = torch.finfo(torch.float32).max
        x[0, 7] = -torch.finfo(torch.float32).max
    elif logits == "one finite":
        x[0] = float("-inf")
        x[0, 11] = 3.0
    seqs = [_seq(0, logprobs=2, **cfg), _seq(1, **cfg)]
    tokens, lps = sample(x, seqs)
    assert all(0 <= t < VOCAB for t in tokens)
    if logits == "one finite":
        assert tokens[0] == 11
    assert lps[1] is None and tokens[0] in lps[0]


def test_tiny_temperature_is_greedy():
    x = torch.randn(1, VOCAB)
    for i in range(5):
        assert sample(x, [_seq(i, temperature=1e-300)])[0] == [int(x.argmax())]


def test_sampling_still_follows_the_distribution():
    """The guards change nothing for ordinary input: frequencies follow softmax(logits / T)."""
    x = torch.tensor([[2.0, 1.0, 0.0] + [-math.inf] * (VOCAB - 3)])
    s = _seq(3, temperature=1.0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(x, [s])[0][0]] += 1
    assert torch.allclose(counts / 3000, x[0, :3].softmax(-1), atol=0.04)
