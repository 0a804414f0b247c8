"""Speculative decoding with n-gram (prompt lookup) proposals: configuration checks, proposals, greedy
output token-identical to decoding without speculation (tiny Llama and Qwen3; under preemption, with
prefix caching; the default model in a slow case), the block manager after every step, request options
(penalties, logprobs, stop strings, max_tokens, n, the per-request opt-out) and the back-off rules.
The distribution of sampled tokens is checked in test_speculative_distribution.py."""
from __future__ import annotations

import dataclasses
import random

import pytest

import lmport
from lmport.config import ConfigError, EngineConfig, GenerationConfig, SpeculativeConfig
from lmport.speculative import ngram
from lmport.speculative.speculator import FIRST_PAUSE, Payoff, ProposalLength, Speculator
from support.paging_invariants import check_block_manager
from support.model_helpers import tiny_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64, "pause_when_slower": False}


# -- configuration --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    ({"method": "eagle"}, "method must be one of ngram, draft"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int in [1, 16]"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens must be an int in [1, 16]"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an int"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an int >= 1"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min=5 is more than prompt_lookup_max=3"),
    ({"method": "draft"}, "needs speculative.model"),
    ({"model": "smollm2"}, "only read by method 'draft'"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be an int >= 1"),
    ({"min_acceptance": 1.0}, "min_acceptance must be a number in [0, 1)"),
    ({"pause_when_slower": 1}, "pause_when_slower must be True or False"),
    ({"typo": 1}, "unknown field(s) typo"),
])
def test_bad_speculative_config_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(device_type="cpu", speculative=fields)


def test_speculative_config_from_dict_and_opt_out_flag():
    cfg = EngineConfig(device_type="cpu", speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.speculative == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="speculate must be True or False"):
        GenerationConfig(speculate=1)   # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="speculative must be a dict"):
        EngineConfig(device_type="cpu", speculative="ngram")   # type: ignore[arg-type]


# -- proposals ----------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert ngram.propose([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert ngram.propose([1, 2, 3, 4, 1, 2], 5, 1, 3) == [3, 4, 1, 2, 3]        # on into the proposal itself
    assert ngram.propose([8, 7, 7, 7], 4, 1, 2) == [7, 7, 7, 7]
    assert ngram.propose([5, 1, 2, 7, 9, 1, 2, 8, 0, 1, 2], 2, 2, 3) == [8, 0]   # latest occurrence
    assert ngram.propose([3, 1, 2, 6, 4, 2, 7], 2, 2, 3) == []                  # no 2-gram match
    assert ngram.propose([3, 1, 2, 6, 4, 2, 7, 5, 2], 2, 1, 3) == [7, 5]        # a 1-gram match
    assert ngram.propose([9, 4, 1, 2, 5, 4, 1, 2, 6, 1, 2], 1, 2, 3) == [6]     # the 3-gram first: 4 1 2 -> 6
    assert ngram.propose([1, 2], 4, 2, 2) == []


# -- the engine -----------------------------------------------------------------------------------

def repeating_prompts(count: int, seed: int = 3) -> list[list[int]]:
    """Random prompts that repeat a span of themselves (what prompt lookup finds), of varied lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        span = [rng.randrange(3, 40000) for _ in range(rng.randrange(8, 40))]
        head = [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 30))]
        prompts.append(head + span + [rng.randrange(3, 40000)] + span[:rng.randrange(2, len(span))])
    return prompts


def generate(model, prompts, gen: GenerationConfig, *, check_blocks=False, **config):
    """Responses and usage() of one engine run; with ``check_blocks``, the block manager's accounting after
    every step and every running sequence holding exactly the blocks of its computed tokens."""
    cfg = EngineConfig(device_type="cpu", block_size=16, **config)
    with lmport.pipeline(model, backend_config=cfg) as pipe:
        engine = pipe.engine
        if check_blocks:
            step = engine.step

            def checked_step():
                outputs = step()
                bm = engine.block_manager
                check_block_manager(bm, engine.seqs.values())
                for seq in engine.scheduler.running:
                    assert len(seq.block_table) == bm.blocks_for(seq.num_computed), seq.request_id
                return outputs
            engine.step = checked_step
        responses = pipe.generate(prompts, gen)
        usage = engine.usage()
        cached = engine.block_manager.cache
        entries = list(cached.device.values()) + list(cached.host.values()) if cached is not None else []
    assert usage["blocks_used"] == 0, "every block must be free once all requests finished"
    return responses, usage, entries


def chain_tokens(entry) -> list[int]:
    tokens = []
    while entry is not None:
        tokens[:0] = entry.tokens
        entry = entry.parent
    return tokens


GREEDY = GenerationConfig(max_new_tokens=64, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_identical_to_no_speculation(arch):
    model, prompts = tiny_model_dir(arch), repeating_prompts(16)
    plain, _, _ = generate(model, prompts, GREEDY, cache_max_entry_count=200)
    spec, usage, _ = generate(model, prompts, GREEDY, cache_max_entry_count=200, check_blocks=True,
                              speculative=NGRAM)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(len(r.token_ids) == 64 for r in spec)
    # The comparison means something only if proposals were made and some accepted, some rejected.
    assert usage["spec_accepted_tokens"] > 0 and usage["spec_accepted_tokens"] < usage["spec_proposed_tokens"]
    assert 1 < usage["spec_mean_acceptance_length"] <= 1 + NGRAM["num_speculative_tokens"]


def test_greedy_identical_under_preemption():
    model, prompts = tiny_model_dir("llama"), repeating_prompts(16, seed=5)
    plain, _, _ = generate(model, prompts, GREEDY, cache_max_entry_count=200)
    # 20 blocks of 16 tokens cannot hold 16 sequences of ~40-150 tokens: the scheduler must preempt.
    spec, usage, _ = generate(model, prompts, GREEDY, cache_max_entry_count=20, max_prefill_token_num=128,
                              check_blocks=True, speculative=NGRAM)
    assert usage["preemptions"] > 0 and usage["spec_accepted_tokens"] > 0
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_greedy_identical_with_prefix_caching_and_cache_holds_only_accepted_tokens():
    model, rng = tiny_model_dir("llama"), random.Random(9)
    shared = [rng.randrange(3, 40000) for _ in range(40)]
    prompts = [shared + p for p in repeating_prompts(16, seed=7)]
    plain, _, _ = generate(model, prompts, GREEDY, cache_max_entry_count=200)
    # Four at a time: later requests find the shared prefix (and earlier outputs' blocks) cached.
    spec, usage, entries = generate(model, prompts, GREEDY, cache_max_entry_count=200, check_blocks=True,
                                    enable_prefix_caching=True, max_batch_size=4, speculative=NGRAM)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert usage["prefix_cache_hit_blocks_device"] > 0 and usage["spec_accepted_tokens"] > 0
    # Every cached chain (prompt and generated blocks alike) is a prefix of a request's real tokens: no
    # block holding a rejected proposal was ever indexed.
    texts = [p + r.token_ids for p, r in zip(prompts, spec)]
    assert entries and any(len(chain_tokens(e)) > len(p) for e in entries for p in prompts[:1])
    for e in entries:
        chain = chain_tokens(e)
        assert any(t[:len(chain)] == chain for t in texts), e


def test_greedy_identical_with_int8_kv_and_the_host_tier():
    """quant_policy=8 and prefix caching with a device cache too small to keep the first pass's blocks: the
    verified rows read int8 KV, and the second pass over the same prompts finds blocks (prompts and accepted
    tokens) on the host."""
    model = tiny_model_dir("llama")
    prompts = repeating_prompts(8, seed=23)
    config = dict(quant_policy=8, enable_prefix_caching=True, host_cache_gib=0.02, cache_max_entry_count=40,
                  max_batch_size=3)
    plain, _, _ = generate(model, prompts * 2, GREEDY, **config)
    spec, usage, _ = generate(model, prompts * 2, GREEDY, check_blocks=True, speculative=NGRAM, **config)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert usage["spec_accepted_tokens"] > 0 and usage["blocks_from_host"] > 0, usage


@pytest.mark.slow   # the default run has tp=2 speculation with a draft model (test_speculative_draft.py)
def test_greedy_identical_at_tp2():
    """Under tensor parallelism the driver proposes and judges; every rank runs the verifying forward."""
    model, prompts = tiny_model_dir("llama"), repeating_prompts(6, seed=29)
    plain, _, _ = generate(model, prompts, GREEDY, tp=2, cache_max_entry_count=100)
    spec, usage, _ = generate(model, prompts, GREEDY, tp=2, cache_max_entry_count=100, speculative=NGRAM)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert 0 < usage["spec_accepted_tokens"] < usage["spec_proposed_tokens"], usage


def test_request_options_work_as_without_speculation():
    """Penalties, logprobs, stop strings, max_tokens and n: the same tokens, texts, logprobs and finish
    reasons with speculation as without."""
    from lmport.models.loader import load_tokenizer
    model = tiny_model_dir("llama")
    prompts = repeating_prompts(4, seed=11)
    # A random model's output rarely repeats itself; biased towards four tokens, it writes in their alphabet,
    # where proposals are frequent and often rejected, and the penalties decide what comes next.
    bias = {t: 8.0 for t in (101, 202, 303, 404)}
    biased = GenerationConfig(max_new_tokens=40, ignore_eos=True, logit_bias=bias)
    plain_tokens, _, _ = generate(model, prompts, biased, cache_max_entry_count=100)
    # A stop string the first output reaches late (after proposals have been verified): two tokens whose text
    # first appears at or after its 12th token.
    tok, out = load_tokenizer(model), plain_tokens[0].token_ids
    stop = next(text for i in range(12, 38)
                if (text := tok.decode(out[i:i + 2])).strip() and text not in tok.decode(out[:i + 1]))
    configs = [dataclasses.replace(biased, **fields) for fields in (
        {"repetition_penalty": 1.3}, {"frequency_penalty": 0.1, "presence_penalty": 0.5}, {"logprobs": 3},
        {"stop_words": [stop]}, {"max_new_tokens": 21})]
    results = []
    for gen in configs:
        plain, _, _ = generate(model, prompts, gen, cache_max_entry_count=100)
        spec, usage, _ = generate(model, prompts, gen, cache_max_entry_count=100, speculative=NGRAM)
        assert usage["spec_verifications"] > 0, gen
        for a, b in zip(plain, spec):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), gen
            assert len(b.logprobs) == len(a.logprobs)
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
        results.append((plain, spec))
    stopped = results[3][1][0]   # the first prompt, speculating, under the stop string
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    penalized = results[0][0]    # without speculation, under repetition_penalty 1.3
    assert [r.token_ids for r in penalized] != [r.token_ids for r in plain_tokens]   # the penalty mattered
    # n: several sampled choices of one prompt, each its own generator, all complete.
    with lmport.pipeline(model, backend_config=EngineConfig(device_type="cpu", speculative=NGRAM,
                                                            cache_max_entry_count=100)) as pipe:
        outs = pipe.generate([prompts[0]] * 4, GenerationConfig(max_new_tokens=20, ignore_eos=True, do_sample=True,
                                                               temperature=0.5, random_seed=1))
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in outs)


def test_structured_outputs_speculate_and_match_without_speculation():
    """A regex and a JSON schema: the same tokens as without speculation, every output in its format, and
    proposals the format forbids (the prompt's "green") rejected by the masked rows."""
    import json
    import re

    from lmport.models.loader import load_tokenizer
    model = tiny_model_dir("llama")
    tok = load_tokenizer(model)
    words = ["red", "blue", "green"]
    rng = random.Random(17)
    prompts = [tok.encode(" ".join(rng.choice(words) for _ in range(30)) + " ") for _ in range(6)]
    regex = "(red |blue ){24}"
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                           "minItems": 12, "maxItems": 12}},
              "required": ["colors"], "additionalProperties": False}
    formats = [{"type": "regex_schema", "regex_schema": regex},
               {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}]
    for fmt in formats:
        gen = GenerationConfig(max_new_tokens=80, response_format=fmt)
        plain, _, _ = generate(model, prompts, gen, cache_max_entry_count=100)
        spec, usage, _ = generate(model, prompts, gen, cache_max_entry_count=100, check_blocks=True,
                                  speculative=NGRAM)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], fmt
        assert all(r.finish_reason == "stop" for r in spec), [r.finish_reason for r in spec]
        for r in spec:
            if fmt["type"] == "regex_schema":
                assert re.fullmatch(regex, r.text), r.text
            else:
                assert len(json.loads(r.text)["colors"]) == 12
        assert 0 < usage["spec_accepted_tokens"] < usage["spec_proposed_tokens"], (fmt, usage)
    # Sampled: every output still in its format.
    sampled = GenerationConfig(max_new_tokens=80, response_format=formats[0], do_sample=True, temperature=1.0,
                               random_seed=3)
    spec, usage, _ = generate(model, prompts, sampled, cache_max_entry_count=100, speculative=NGRAM)
    assert usage["spec_verifications"] > 0 and all(re.fullmatch(regex, r.text) for r in spec)


def test_a_structured_proposals_masks_are_filled_while_the_forward_runs(monkeypatch):
    """The verification masks of a constrained proposal are filled on the grammar threads beside the forward
    that verifies it, not after: each verifying forward, held until its proposal's fill is done, ends."""
    import time
    from lmport.structured_output.grammar import Matcher
    from lmport.models.loader import load_tokenizer
    proposal_bitmask, fills, fills_at_forward_end = Matcher.proposal_bitmask, [], []

    def counted(self, proposal, vocab_size):
        result = proposal_bitmask(self, proposal, vocab_size)
        fills.append(proposal)
        return result
    monkeypatch.setattr(Matcher, "proposal_bitmask", counted)
    model = tiny_model_dir("llama")
    prompt = load_tokenizer(model).encode("red blue " * 20)
    gen = GenerationConfig(max_new_tokens=12, response_format={"type": "regex_schema", "regex_schema": "(red |blue )+"})
    cfg = EngineConfig(device_type="cpu", block_size=16, cache_max_entry_count=100, speculative=NGRAM)
    with lmport.pipeline(model, backend_config=cfg) as pipe:
        execute = pipe.engine.executor.execute

        def slow_verification(step):
            logits = execute(step)
            if len(step.token_ids) > len(step.q_lens) and len(step.q_lens) == 1 and step.q_lens[0] <= 5:
                # a verifying forward of the one sequence (the prompt's is longer); a fill made only after the
                # forward returns would hold it to the limit and be counted short
                wanted, limit = len(fills_at_forward_end) + 1, time.monotonic() + 30
                while len(fills) < wanted and time.monotonic() < limit:
                    time.sleep(0.001)
                fills_at_forward_end.append(len(fills))
            return logits
        pipe.engine.executor.execute = slow_verification
        pipe.generate([prompt], gen)
    assert fills_at_forward_end, "no proposal was verified: the test proves nothing"
    assert fills_at_forward_end == list(range(1, len(fills_at_forward_end) + 1)), fills_at_forward_end


def test_a_format_dead_end_inside_a_proposal_ends_the_request_as_without_speculation(monkeypatch):
    """A grammar that allows no token after its DEAD_AT-th: speculation emits the same tokens before the dead
    end and ends the request with the same error, whether the dead end falls on a plain step or inside a
    verified proposal (which must happen here, or the test proves nothing)."""
    from lmport.structured_output.grammar import Matcher
    from lmport.models.loader import load_tokenizer
    dead_at = 9
    fill, accept, rollback, proposal_bitmask = (Matcher.fill_next_token_bitmask, Matcher.accept_token,
                                                Matcher.rollback, Matcher.proposal_bitmask)
    dead_in_proposals = []

    def counted_accept(self, token):
        accepted = accept(self, token)
        self.tokens_in = getattr(self, "tokens_in", 0) + accepted
        return accepted

    def counted_rollback(self, num_tokens):
        rollback(self, num_tokens)
        self.tokens_in -= num_tokens

    def dead_fill(self, bitmask, row):
        fill(self, bitmask, row)
        if getattr(self, "tokens_in", 0) >= dead_at:
            bitmask[row] = 0   # what xgrammar fills when no token can continue or end the output

    def watched_proposal_bitmask(self, proposal, vocab_size):
        result = proposal_bitmask(self, proposal, vocab_size)
        dead_in_proposals.append(result[2] is not None and result[2] > 0)
        return result

    monkeypatch.setattr(Matcher, "accept_token", counted_accept)
    monkeypatch.setattr(Matcher, "rollback", counted_rollback)
    monkeypatch.setattr(Matcher, "fill_next_token_bitmask", dead_fill)
    monkeypatch.setattr(Matcher, "proposal_bitmask", watched_proposal_bitmask)
    model = tiny_model_dir("llama")
    tok = load_tokenizer(model)
    prompts = [tok.encode("red blue " * 20) for _ in range(3)]
    gen = GenerationConfig(max_new_tokens=40, response_format={"type": "regex_schema", "regex_schema": "(red |blue )+"})
    plain, _, _ = generate(model, prompts, gen, cache_max_entry_count=100)
    spec, usage, _ = generate(model, prompts, gen, cache_max_entry_count=100, check_blocks=True, speculative=NGRAM)
    assert all(r.finish_reason == "error" and "dead end" in (r.error or "") for r in plain), plain
    assert all(len(r.token_ids) == dead_at for r in plain)
    assert [(r.token_ids, r.finish_reason, r.error) for r in spec] == [(r.token_ids, r.finish_reason, r.error)
                                                                       for r in plain]
    assert usage["spec_accepted_tokens"] > 0 and any(dead_in_proposals)


def test_proposals_grow_while_accepted_whole_and_shrink_when_cut_short():
    """transformers' heuristic schedule: from half the most, two longer after a proposal accepted whole, one
    shorter after one cut short, within [1, num_speculative_tokens]."""
    from lmport.sched.sequence import Sequence
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=7, min_acceptance=0), session_len=1000,
                      num_running=lambda: 1)
    seq = Sequence("a", [1, 2, 3] * 10, GenerationConfig(max_new_tokens=100))
    lengths = []
    for accepted_share in (1, 1, 1, 1, 0, 0.5, 0, 0, 0, 0):
        n = spec.lookahead(seq)
        lengths.append(n)
        spec.record(seq, n, int(n * accepted_share))
    assert lengths == [3, 5, 7, 7, 7, 6, 5, 4, 3, 2]
    assert ProposalLength.next(1, 1, 0, 7) == 1 and ProposalLength.first(1) == 1


def test_opt_out_and_batch_cut_off_mean_no_speculation():
    model, prompts = tiny_model_dir("llama"), repeating_prompts(8, seed=13)
    _, usage, _ = generate(model, prompts, GenerationConfig(max_new_tokens=16, ignore_eos=True, speculate=False),
                           cache_max_entry_count=100, speculative=NGRAM)
    assert usage["spec_verifications"] == 0
    _, usage, _ = generate(model, prompts, GenerationConfig(max_new_tokens=16, ignore_eos=True),
                           cache_max_entry_count=100, speculative=dict(NGRAM, disable_by_batch_size=7))
    # Eight sequences run together until the first finishes: only the last steps, with fewer running, speculate.
    assert usage["spec_verifications"] <= 7 * 16 and usage["steps"] >= 16


def test_low_acceptance_pauses_a_sequence():
    from lmport.sched.sequence import Sequence
    spec = Speculator(SpeculativeConfig(min_acceptance=0.5), session_len=1000, num_running=lambda: 1)
    seq = Sequence("a", [1, 2, 3, 1, 2], GenerationConfig(max_new_tokens=100))
    assert spec.lookahead(seq) == 4           # 1 2 -> 3 1 2 3, the default num_speculative_tokens
    for _ in range(2):                        # 1.0 -> 0.7 -> 0.49: under min_acceptance
        spec.record(seq, 2, 0)
    assert spec.usage()["spec_pauses"] == 1
    assert [spec.lookahead(seq) for _ in range(FIRST_PAUSE)] == [0] * FIRST_PAUSE
    assert spec.lookahead(seq) == 4 - 2 * ProposalLength.SHRINK   # two proposals cut short
    busy = Speculator(SpeculativeConfig(disable_by_batch_size=2), session_len=1000, num_running=lambda: 3)
    assert busy.lookahead(seq) == 0
    short = Speculator(SpeculativeConfig(), session_len=1000, num_running=lambda: 1)
    assert short.lookahead(Sequence("b", [1, 2, 3, 1, 2], GenerationConfig(max_new_tokens=2))) == 1


def test_payoff_pauses_speculation_while_verifying_is_slower():
    payoff = Payoff()
    for _ in range(Payoff.SAMPLES):                  # verified steps first: no plain rate to compare with yet
        payoff.observe(1, True, 2, 0.03)
    assert payoff.pause == Payoff.SAMPLES            # plain steps are measured first
    for _ in range(Payoff.SAMPLES):
        payoff.observe(1, False, 1, 0.01)            # 100 tokens/s against the verified steps' 67
    assert payoff.pause == 0 and payoff.judged_slower == 0
    payoff.observe(1, True, 2, 0.03)
    assert payoff.judged_slower == 1 and payoff.pause == Payoff.FIRST_PAUSE
    for _ in range(Payoff.FIRST_PAUSE):
        payoff.observe(1, False, 1, 0.01)
    for _ in range(Payoff.SAMPLES):                  # judged afresh, from new samples only
        payoff.observe(1, True, 2, 0.03)
    assert payoff.judged_slower == 2 and payoff.pause == 2 * Payoff.FIRST_PAUSE
    faster = Payoff()
    for verified, tokens in [(False, 1)] * Payoff.SAMPLES + [(True, 4)] * 3 * Payoff.SAMPLES:
        faster.observe(2, verified, tokens, 0.01)    # verified steps as long, more tokens: never paused
        assert faster.pause == 0
    assert faster.judged_slower == 0
    faster.observe(1, True, 2, 0.03)                 # another batch size is judged on its own
    assert faster.rates[(1, True)] == pytest.approx(2 / 0.03)


@pytest.mark.slow
def test_default_model_greedy_identical():
    from lmport.models.loader import load_tokenizer
    tok = load_tokenizer("smollm2")
    texts = ["Copy this list: apples, pears, plums, cherries, figs, dates, limes.",
             "def area(r):\n    return 3.14159 * r * r\n\nRewrite the function above with a docstring:\n",
             "The quick brown fox jumps over the lazy dog. The quick brown fox",
             "Summarize: Paged attention stores the KV cache in fixed-size blocks. Summary:"]
    prompts = [tok.encode(t) for t in texts] + repeating_prompts(12, seed=17)
    for weights in ("dequantize", "auto"):
        plain, _, _ = generate("smollm2", prompts, GREEDY, cache_max_entry_count=400, weight_format=weights)
        spec, usage, _ = generate("smollm2", prompts, GREEDY, cache_max_entry_count=400, weight_format=weights,
                                  speculative=NGRAM, check_blocks=True)
        assert usage["spec_accepted_tokens"] > 0
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], weights


def test_metrics_show_acceptance():
    from lmport.server.metrics import Metrics
    spec = Speculator(SpeculativeConfig(), session_len=1000, num_running=lambda: 1)
    spec.stats.update(verifications=4, proposed_tokens=10, accepted_tokens=6)
    usage = {"running": 1, "waiting": 0, "blocks_used": 1, "blocks_total": 8, **spec.usage()}
    samples = {s.name: s.value for m in Metrics(lambda: usage).registry.collect() for s in m.samples}
    assert samples["lmport_spec_decode_acceptance_rate"] == 0.6
    assert samples["lmport_spec_decode_mean_acceptance_length"] == 2.5
    assert samples["lmport_spec_decode_accepted_tokens_total"] == 6
