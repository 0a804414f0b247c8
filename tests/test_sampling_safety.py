"""The sampler never raises on a valid GenerationConfig, whatever the logits; the engine contains what does."""
from __future__ import annotations

import math

import pytest
import torch

from lmport.config import GenerationConfig
from lmport.worker.sampling import TEMPERATURE_FLOOR, greedy_tokens, sample
from lmport.sched.sequence import Sequence

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


def test_greedy_tokens_are_torch_max_indices():
    """The host's numpy argmax picks what torch's max does: the first of tied largest values, -inf rows included."""
    x = torch.randn(6, 49152)
    x[1, [5, 900, 40000]] = 100.0                # ties: the first
    x[2] = float("-inf")                          # nothing finite: index 0
    x[3] = float("-inf")
    x[3, 49151] = -1e30
    x[4, 123] = float("inf")
    x[5] = 0.0
    assert greedy_tokens(x) == x.max(-1).indices.tolist() == [int(x[0].argmax()), 5, 0, 49151, 123, 0]
    assert greedy_tokens(x[::2]) == x[::2].max(-1).indices.tolist()   # rows of a strided view


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["host numpy", "torch max"])
def test_greedy_tokens_read_nan_as_minus_infinity(dtype):
    x = torch.randn(5, 49152)
    x[0, [3, 700]] = float("nan")                 # before and after the largest value
    x[0, 500] = 50.0
    x[1] = float("nan")                           # nothing but NaN: index 0, as for -inf
    x[2] = float("-inf")
    x[2, [0, 9]] = float("nan")
    x[2, 40000] = -1e30
    x[4, 0] = float("nan")
    expected = x.nan_to_num(nan=float("-inf")).max(-1).indices.tolist()
    assert expected[:3] == [500, 0, 40000]
    assert greedy_tokens(x.to(dtype)) == expected
    assert greedy_tokens(x.to(dtype)[::2]) == expected[::2]   # rows of a strided view


def test_greedy_never_picks_nan():
    x = torch.randn(1, VOCAB)
    x[0, 3] = float("nan")
    x[0, 8] = 50.0
    assert sample(x, [Sequence("s", [1, 2], GenerationConfig())])[0] == [8]


def test_sampling_still_follows_the_distribution():
    """The guards change nothing for ordinary input: frequencies follow softmax(logits / T)."""
    x = torch.tensor([[2.0, 1.0, 0.0] + [-math.inf] * (VOCAB - 3)])
    s = _seq(3, temperature=1.0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(x, [s])[0][0]] += 1
    assert torch.allclose(counts / 3000, x[0, :3].softmax(-1), atol=0.04)


def full_sort_filter(logits, top_k, top_p, min_p):
    """top-k, top-p and min-p over the whole sorted vocabulary, row by row: what _filter must equal."""
    out = logits.clone()
    for i, row in enumerate(logits):
        order = row.argsort(descending=True)
        probs = row[order].softmax(-1)
        k = int(top_k[i]) if 0 < int(top_k[i]) < len(row) else len(row)
        remove = torch.arange(len(row)) >= k
        if top_p[i] < 1:   # over what top-k keeps, renormalised
            in_k = row[order].masked_fill(remove, float("-inf")).softmax(-1)
            remove |= (in_k.cumsum(-1) - in_k) >= top_p[i]
        remove |= probs < min_p[i] * probs[0]
        remove[0] = False
        out[i, order[remove]] = float("-inf")
    return out


def test_filter_equals_a_full_sort_of_every_row():
    """Rows that filter are filtered over their likeliest tokens, and a flat row's top-p past them; others
    untouched. Peaked and flat rows, every mix of top-k, top-p and min-p, at a real vocabulary's size."""
    from lmport.worker.sampling import CANDIDATES, _filter
    g = torch.Generator().manual_seed(0)
    vocab = 49152
    configs = [(0, 1.0, 0.0), (40, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.05), (50, 0.8, 0.02), (0, 0.95, 0.0),
               (2000, 0.99, 0.0), (vocab + 5, 0.5, 0.0), (1, 1.0, 0.0), (0, 0.3, 1e-4)]
    scales = [8.0, 0.05]   # peaked rows, and flat ones whose top-p needs more than CANDIDATES tokens
    rows = [(c, s) for c in configs for s in scales]
    logits = torch.stack([torch.randn(vocab, generator=g) * s for _, s in rows])
    top_k = torch.tensor([c[0] for c, _ in rows])
    top_p = torch.tensor([c[1] for c, _ in rows])
    min_p = torch.tensor([c[2] for c, _ in rows])
    got = _filter(logits, top_k, top_p, min_p)
    want = full_sort_filter(logits, top_k, top_p, min_p)
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[~got.isinf()], want[~want.isinf()])
    flat_top_p = (top_p < 1) & (top_k == 0) & (min_p == 0) & (logits.std(-1) < 1)
    assert ((~got.isinf()).sum(-1)[flat_top_p] > CANDIDATES).all()   # the flat rows did reach past them
    assert torch.equal(got[0], logits[0]) and torch.equal(got[1], logits[1])   # (0, 1, 0): untouched


def test_draw_follows_the_distribution_and_is_each_rows_own():
    from lmport.worker.sampling import DRAW_CHUNK, draw
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 6.0]])   # unnormalised too
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    counts = torch.zeros(3, 4)
    for _ in range(4000):
        counts[torch.arange(3), draw(probs, gens)] += 1
    assert torch.allclose(counts / 4000, probs / probs.sum(-1, keepdim=True), atol=0.03)
    assert (counts[probs == 0] == 0).all()
    # A seed draws the same tokens alone as beside other rows.
    alone_gen, mine, other = (torch.Generator().manual_seed(seed) for seed in (7, 7, 9))
    alone = [int(draw(probs[:1], [alone_gen])[0]) for _ in range(50)]
    together = [int(draw(probs[[2, 0]], [other, mine])[1]) for _ in range(50)]
    assert alone == together and len(set(alone)) == 3
    # Over chunks of DRAW_CHUNK tokens: one without mass between two with, the last one padded.
    wide = torch.zeros(1, 2 * DRAW_CHUNK + 500)
    where = [3, 2 * DRAW_CHUNK + 7, 2 * DRAW_CHUNK + 499]
    wide[0, where] = torch.tensor([0.2, 0.5, 0.3])
    gen = torch.Generator().manual_seed(0)
    drawn = torch.cat([draw(wide, [gen]) for _ in range(4000)])
    assert set(drawn.tolist()) == set(where)
    assert torch.allclose(torch.stack([(drawn == w).float().mean() for w in where]), wide[0, where], atol=0.03)
