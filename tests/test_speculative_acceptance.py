"""The acceptance rule of speculative sampling (lmport.speculative.acceptance), without a model: exact on
small hand-made distributions, and by a fixed-seed sample of one batched ``verify`` call.

With the target's distribution p and the draft's q at a position, a proposed token d (drawn from q) is
accepted with probability min(1, p(d) / q(d)); a rejection draws from norm(max(0, p - q)). One step then
emits x with probability min(p(x), q(x)) + (1 - sum min(p, q)) * norm(max(0, p - q))(x) = p(x). An n-gram
proposal is a point mass (q(d) = 1): accepted with probability p(d), a rejection draws from p without d.

The distribution tests with a model (test_speculative_distribution.py, test_speculative_draft_distribution.py)
are slow-marked; these run in the default run and fail for a rule that accepts at 2p/q or draws a rejected
position from p itself.
"""
from __future__ import annotations

import pytest
import torch

from lmport.config import GenerationConfig
from lmport.speculative import acceptance
from lmport.speculative.acceptance import accepts, residual, verify
from lmport.sched.sequence import Sequence

# Hand-made distributions over 5 tokens. p0 gives token 4 no mass while q0 proposes it: it is never emitted.
P = torch.tensor([[0.20, 0.30, 0.10, 0.40, 0.00],
                  [0.05, 0.15, 0.50, 0.10, 0.20],
                  [0.25, 0.25, 0.25, 0.15, 0.10]])
Q = torch.tensor([[0.40, 0.20, 0.20, 0.10, 0.10],
                  [0.10, 0.30, 0.20, 0.30, 0.10]])
NGRAM_PROPOSAL = [1, 2]
# With these seeds a correct rule gives p-values of 0.3 to 0.9 at every position, a 2p/q rule under 1e-180.
SEQUENCES = 2000


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- accepts --------------------------------------------------------------------------------------------------------

# (p(d), q(d)) with q a power of two, so u * q < p and u < p / q agree bit for bit.
@pytest.mark.parametrize("p_d,q_d", [(0.15625, 0.5), (0.375, 1.0), (0.5, 0.125), (0.25, 0.25), (0.0, 0.25)])
def test_accepts_exactly_when_the_generators_uniform_is_under_p_over_q(p_d, q_d):
    """One uniform u of the request's generator decides: accepted iff u < p/q, i.e. with probability
    min(1, p/q); a point mass (q = 1) is accepted with probability p(d)."""
    decisions = []
    for seed in range(300):
        u = float(torch.rand((), generator=gen(seed)))
        decisions.append(accepts(p_d, q_d, gen(seed)))
        assert decisions[-1] == (u < p_d / q_d), (seed, u)
    if 0 < p_d < q_d:
        assert 0 < sum(decisions) < len(decisions)   # both outcomes occurred: the comparison was tested


# -- residual -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p,q,want", [
    ([0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1], [1.0, 0.0, 0.0, 0.0]),
    ([0.2, 0.3, 0.1, 0.4], [0.4, 0.2, 0.3, 0.1], [0.0, 0.25, 0.0, 0.75]),
    ([0.25, 0.25, 0.5, 0.0], [0.0, 0.5, 0.25, 0.25], [0.5, 0.0, 0.5, 0.0]),   # q without mass where p has some
])
def test_residual_is_max_of_p_minus_q_normalised(p, q, want):
    p, q = torch.tensor(p), torch.tensor(q)
    before = p.clone(), q.clone()
    r = residual(p, q)
    assert torch.allclose(r / r.sum(), torch.tensor(want), atol=1e-6)
    assert torch.equal(p, before[0]) and torch.equal(q, before[1])   # the caller's rows are left alone


def test_residual_of_a_point_mass_is_p_without_the_proposed_token():
    p = torch.tensor([0.2, 0.3, 0.1, 0.4])
    r = residual(p, 3)
    assert torch.allclose(r / r.sum(), torch.tensor([1 / 3, 1 / 2, 1 / 6, 0.0]))
    assert torch.equal(p, torch.tensor([0.2, 0.3, 0.1, 0.4]))   # not zeroed in place


def test_residual_when_nothing_is_left_is_p():
    """p == q (or p a point mass on the proposed token) leaves max(0, p - q) empty: a rejection cannot happen
    there, and the documented fallback is p itself, a distribution draw() can take (not zeros, not NaN)."""
    p = torch.tensor([0.25, 0.5, 0.25, 0.0])
    assert torch.equal(residual(p, p.clone()), p)
    one = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert torch.equal(residual(one, 1), one)


# -- one step in closed form ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("p,q", [
    (P[0], Q[0]), (P[1], Q[1]),
    (P[2], P[2]),                                                           # q == p: everything accepted
    (torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.0, 1.0])),         # disjoint: everything rejected
    (torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.1, 0.2, 0.7])),
])
def test_one_step_emits_p_in_closed_form(p, q):
    """P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum of those) * norm(residual)(x) must be p(x)."""
    accepted = torch.minimum(p, q)   # q * min(1, p / q), 0 where q is 0 (never proposed)
    r = residual(p, q)
    emitted = accepted + (1 - accepted.sum()) * r / r.sum()
    assert torch.allclose(emitted, p, atol=1e-6)


@pytest.mark.parametrize("d", range(4))
def test_one_point_mass_step_emits_p_in_closed_form(d):
    p = torch.tensor([0.2, 0.3, 0.1, 0.4])
    r = residual(p, d)
    emitted = (1 - p[d]) * r / r.sum()
    emitted[d] += p[d]
    assert torch.allclose(emitted, p, atol=1e-6)


# -- verify: greedy -------------------------------------------------------------------------------------------------

def test_greedy_accepts_while_the_argmax_matches_then_takes_the_argmax():
    rows = torch.full((4, 5), -1.0)
    rows[torch.arange(4), torch.tensor([3, 1, 2, 0])] = 1.0   # argmax of each position
    greedy = GenerationConfig()
    cases = [([3, 1, 2], [3, 1, 2, 0]), ([3, 1, 4], [3, 1, 2]), ([2, 1, 2], [3])]
    for proposal, want in cases:
        (v,) = verify(rows, [Sequence("g", [0], greedy)], [proposal], [None])
        assert (v.tokens, v.accepted) == (want, len(want) - 1)


def test_each_position_is_judged_after_the_proposed_tokens_before_it():
    """A greedy request with a presence penalty: position j's penalty counts the first j proposed tokens, so
    a proposal equal to the plain step-by-step output is accepted whole (and one that ignores it would not)."""
    row = torch.tensor([0.0, 0.5, 1.0, 0.2, 1.5, 0.1])
    seq = Sequence("s", [0], GenerationConfig(presence_penalty=2.0))
    # Step by step: 4 (1.5); then 4 is at -0.5, so 2; then 1; then 3.
    (v,) = verify(row.repeat(4, 1), [seq], [[4, 2, 1]], [None])
    assert v.tokens == [4, 2, 1, 3] and v.accepted == 3
    (v,) = verify(row.repeat(3, 1), [seq], [[4, 4]], [None])
    assert v.tokens == [4, 2]


def test_greedy_and_sampled_sequences_in_one_batch_keep_their_own_rows():
    greedy_rows = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 3.0], [3.0, 0.0, 0.0]])
    certain = torch.log(torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))   # p(proposal) = 1: always accepted
    seqs = [Sequence("g", [0], GenerationConfig()),
            Sequence("s", [0], GenerationConfig(do_sample=True), generator=gen(0))]
    g, s = verify(torch.cat([greedy_rows, certain]), seqs, [[1, 2], [2]], [None, torch.tensor([[0.5, 0.0, 0.5]])])
    assert (g.tokens, g.accepted) == ([1, 2, 0], 2)
    assert (s.tokens, s.accepted) == ([2, 0], 1)


# -- verify: sampled, a fixed-seed sample ------------------------------------------------------------------------


def chi_square_p(tokens: list[int], p: torch.Tensor) -> float:
    """p-value of the tokens' counts against p (no token of p 0 may occur)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).double()
    assert counts[p == 0].sum() == 0, "a token the target gives no mass was emitted"
    expected = p.double()[p > 0] * len(tokens)
    stat = ((counts[p > 0] - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2), stat / 2))


def verify_many(kind: str) -> list[list[int]]:
    """One verify call over SEQUENCES sampling sequences, each with its own seed, each proposing two tokens
    (drawn from Q by a draft, or the same n-gram proposal); the emitted tokens of each."""
    drafts = torch.multinomial(Q, SEQUENCES, replacement=True, generator=gen(1234)).T.tolist()
    seqs = [Sequence(f"s{i}", [0], GenerationConfig(do_sample=True), generator=gen(i)) for i in range(SEQUENCES)]
    proposals = drafts if kind == "draft" else [NGRAM_PROPOSAL] * SEQUENCES
    draft_probs = [Q] * SEQUENCES if kind == "draft" else [None] * SEQUENCES
    verdicts = verify(P.log().repeat(SEQUENCES, 1), seqs, proposals, draft_probs)
    return [v.tokens for v in verdicts]


def emitted_distributions_p_values(emitted: list[list[int]]) -> list[float]:
    """Position j's token, among the sequences that emitted one there (all of position j - 1 accepted), must
    be distributed as P[j] whatever happened before it."""
    return [chi_square_p([t[j] for t in emitted if len(t) > j], P[j]) for j in range(3)]


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_verify_emits_the_targets_distribution(kind):
    emitted = verify_many(kind)
    assert {len(t) for t in emitted} == {1, 2, 3}   # rejections at either position, and whole acceptances
    p_values = emitted_distributions_p_values(emitted)
    assert min(p_values) > 1e-3, p_values


def accepts_at_2p_over_q(p_d, q_d, generator):
    return float(torch.rand((), generator=generator)) * q_d < 2 * p_d


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_the_sample_tells_a_rule_that_accepts_at_2p_over_q(kind, monkeypatch):
    """The check above has the power it needs: a rule that accepts at 2p/q is far outside it with this many
    sequences (a rejected position drawn from p itself fails the exact residual tests above, and this too)."""
    monkeypatch.setattr(acceptance, "accepts", accepts_at_2p_over_q)
    assert min(emitted_distributions_p_values(verify_many(kind))) < 1e-6
