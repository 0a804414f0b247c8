"""Speculative decoding's driver side: who speculates this step, their proposals, what was accepted.

The scheduler asks ``lookahead(seq)`` for each decoding sequence and reserves that many extra KV slots
(the proposal is verified in the same forward as the sequence's last token); ``proposals`` then gives the
tokens for the slots reserved: an n-gram lookup's (made in ``lookahead``), or a draft model's, made for all
speculating sequences at once (lmport.speculative.draft). After the forward,
``lmport.speculative.acceptance.verify`` judges the proposals and the engine appends the emitted tokens;
the KV slots of rejected tokens are given back (``BlockManager.rollback``).

Speculation backs off where it does not pay:
- while more than ``disable_by_batch_size`` sequences run: a full batch already reads the weights once
  for many tokens, so verifying rejected proposals would only add work;
- for a sequence whose recent proposals are mostly rejected (an exponential average of its acceptance
  under ``min_acceptance``): it pauses for a number of steps that doubles each time (up to
  ``MAX_PAUSE``) and is reset once its proposals pay again. An n-gram lookup that finds nothing costs
  no verification at all;
- while verifying does not pay on this machine (``Payoff``): decode steps that verified proposals are timed
  against plain ones, tokens emitted a second, and speculation pauses for all sequences while it is the
  slower (for a number of steps that doubles each time, then it is judged afresh). Where a forward's
  cost grows with its tokens (a small model on a CPU), verifying four proposals can cost three plain
  steps, and then even a workload that repeats its prompt gains nothing;
- for requests that opt out (``GenerationConfig.speculate=False``).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmport.config import SpeculativeConfig
from lmport.sched.sequence import Sequence
from lmport.speculative import ngram
from lmport.speculative.draft import DraftModel

log = logging.getLogger(__name__)

EMA_WEIGHT = 0.3     # weight of the latest verification in a sequence's acceptance average
FIRST_PAUSE = 4      # steps a sequence stops proposing after its acceptance falls under min_acceptance
MAX_PAUSE = 64


class Payoff:
    """Whether verifying proposals pays: tokens emitted a second by decode steps that verified proposals
    against steps that did not, with as many sequences in the step. Judged once ``SAMPLES`` steps of each
    kind are timed; a plain rate not yet known is measured by pausing speculation for ``SAMPLES`` steps."""

    SAMPLES = 8          # timed steps of a kind before a judgment
    WEIGHT = 0.2         # weight of the latest step in a rate's exponential average
    FIRST_PAUSE = 32     # decode steps without speculation after it is judged slower; doubles each time
    # At most a sequence's own longest pause: a judgment made on one workload is not to outlive it. A
    # sequence backs off from its own rejected proposals; a longer pause here would only keep the next
    # answer, one that repeats its prompt, from speculating.
    MAX_PAUSE = 64

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock                                # what decode steps are timed with
        self.rates: dict[tuple[int, bool], float] = {}    # (sequences, verified) -> tokens per second
        self.samples: Counter[tuple[int, bool]] = Counter()
        self.pause = 0                                    # decode steps left without speculation
        self.next_pause = self.FIRST_PAUSE
        self.judged_slower = 0

    def observe(self, num_seqs: int, verified: bool, tokens: int, seconds: float) -> None:
        """A decode step of ``num_seqs`` sequences emitted ``tokens`` in ``seconds``."""
        if self.pause:
            self.pause -= 1
        key = (num_seqs, verified)
        rate = tokens / max(seconds, 1e-9)
        self.rates[key] = rate if not self.samples[key] else self.rates[key] + self.WEIGHT * (rate - self.rates[key])
        self.samples[key] += 1
        plain = (num_seqs, False)
        if not verified or self.samples[key] < self.SAMPLES:
            return
        if self.samples[plain] < self.SAMPLES:
            self.pause = self.SAMPLES - self.samples[plain]   # plain steps to compare with
        elif self.rates[key] < self.rates[plain]:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, self.MAX_PAUSE)
            self.samples[key] = 0   # judged afresh after the pause
            self.judged_slower += 1
        else:
            self.next_pause = self.FIRST_PAUSE


@dataclass
class _SeqState:
    acceptance: float = 1.0     # exponential average of accepted / proposed
    pause: int = 0              # steps left without proposals
    next_pause: int = FIRST_PAUSE
    length: int = 1             # tokens the next proposal may have (ProposalLength)


class ProposalLength:
    """How many tokens a sequence proposes: transformers' "heuristic" schedule for assisted generation. A
    proposal accepted whole lets the next be two tokens longer, one cut short makes it one shorter, between
    1 and ``num_speculative_tokens``, from half of that. Where the output copies long spans (the prompt's
    code or text) proposals grow to the most; where they are rejected they shrink, and a verification that
    proposed fewer tokens costs less."""

    GROW = 2
    SHRINK = 1

    @staticmethod
    def first(most: int) -> int:
        return max(1, most // 2)

    @classmethod
    def next(cls, length: int, proposed: int, accepted: int, most: int) -> int:
        if accepted == proposed:
            return min(most, length + cls.GROW)
        return max(1, length - cls.SHRINK)


class Speculator:
    def __init__(self, config: SpeculativeConfig, session_len: int, num_running: Callable[[], int],
                 draft: DraftModel | None = None):
        self.config = config
        self.session_len = session_len
        self.num_running = num_running      # sequences the scheduler runs now
        self.draft = draft                  # method "draft": the model that proposes
        self._proposals: dict[Sequence, list[int]] = {}   # n-gram proposals made in lookahead; [] for the draft's
        self._states: dict[Sequence, _SeqState] = {}
        self.payoff = Payoff() if config.pause_when_slower else None
        self.stats: Counter[str] = Counter()

    # -- before the forward ------------------------------------------------
    def lookahead(self, seq: Sequence) -> int:
        """Proposed tokens ``seq`` verifies this step (KV slots the scheduler reserves besides its last token)."""
        self._proposals.pop(seq, None)
        cfg = self.config
        if (not seq.gen_config.speculate or seq.pooling is not None
                or self.num_running() > cfg.disable_by_batch_size or (self.payoff and self.payoff.pause)):
            return 0
        state = self._state(seq)
        if state.pause:
            state.pause -= 1
            return 0
        # Room: no position past session_len, and no more tokens than the request may still emit (the
        # target adds one of its own after the accepted ones).
        room = min(state.length, self.session_len - seq.num_tokens,
                   seq.gen_config.max_new_tokens - len(seq.output_ids) - 1)
        if room < 1:
            return 0
        if self.draft is not None:   # the draft proposes in ``proposals``, for every speculating sequence at once
            self._proposals[seq] = []
            return room
        proposal = ngram.propose(seq.token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if proposal:
            self._proposals[seq] = proposal
        return len(proposal)

    def proposals(self, slots: dict[Sequence, int]
                  ) -> tuple[dict[Sequence, list[int]], dict[Sequence, torch.Tensor | None]]:
        """The proposal each sequence verifies in its reserved ``slots`` (fewer tokens than asked in lookahead
        when the budget was short), and the draft probabilities they were drawn from (None: a point mass).
        A draft that fails proposes nothing this step: the sequences decode one token, as without speculation."""
        if self.draft is None:
            return {s: self._proposals.pop(s, [])[:n] for s, n in slots.items()}, {}
        for s in slots:
            self._proposals.pop(s, None)
        seqs = list(slots)
        if not seqs:
            return {}, {}
        try:
            tokens, probs = self.draft.propose(seqs, [slots[s] for s in seqs])
        except Exception:
            log.exception("the draft model failed to propose for %d sequences; they decode without proposals",
                          len(seqs))
            for s in seqs:
                self.draft.forget(s)
            return {}, {}
        return dict(zip(seqs, tokens)), dict(zip(seqs, probs))

    # -- after verification ------------------------------------------------
    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.stats["verifications"] += 1
        self.stats["proposed_tokens"] += proposed
        self.stats["accepted_tokens"] += accepted
        state = self._state(seq)
        state.length = ProposalLength.next(state.length, proposed, accepted, self.config.num_speculative_tokens)
        state.acceptance += EMA_WEIGHT * (accepted / proposed - state.acceptance)
        if state.acceptance < self.config.min_acceptance:
            state.pause, state.next_pause = state.next_pause, min(2 * state.next_pause, MAX_PAUSE)
            state.acceptance = 1.0   # judged afresh after the pause
            self.stats["pauses"] += 1
        elif accepted == proposed:
            state.next_pause = FIRST_PAUSE

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _SeqState(length=ProposalLength.first(self.config.num_speculative_tokens))
        return state

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: drop what is kept about it."""
        self._proposals.pop(seq, None)
        self._states.pop(seq, None)
        if self.draft is not None:
            self.draft.forget(seq)

    def usage(self) -> dict:
        s = self.stats
        return {
            "spec_method": self.config.method,
            "spec_verifications": s["verifications"],
            "spec_proposed_tokens": s["proposed_tokens"],
            "spec_accepted_tokens": s["accepted_tokens"],
            # accepted / proposed tokens
            "spec_acceptance_rate": s["accepted_tokens"] / s["proposed_tokens"] if s["proposed_tokens"] else 0.0,
            # tokens a sequence gained per verifying step, its own token included (vLLM's mean acceptance length)
            "spec_mean_acceptance_length": (1 + s["accepted_tokens"] / s["verifications"]
                                            if s["verifications"] else 0.0),
            "spec_pauses": s["pauses"],
            # times verifying was judged slower than plain decoding (Payoff)
            "spec_judged_slower": self.payoff.judged_slower if self.payoff else 0,
        }
