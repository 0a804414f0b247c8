"""Speculative decoding with a draft model (method "draft"): the checks made before weights load, greedy output
token-identical to decoding without speculation (tiny Llama and Qwen3 drafted by their own first layer; under
preemption, with prefix caching), the block manager after every step, a model drafting for itself (every
proposal accepted), seeded sampling, and the draft's cache in the plan and in the engine.
The sampled distribution is checked in test_speculative_draft_distribution.py."""
from __future__ import annotations

import functools
import random

import pytest

import lmport
from lmport.config import ConfigError, EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.models.loader import load_tokenizer
from lmport.speculative.draft import check_same_tokens
from lmport.speculative.speculator import Payoff
from support.model_helpers import tiny_draft_dir, tiny_model_dir
from test_speculative import GREEDY, chain_tokens, generate, repeating_prompts


def draft_spec(model: str, **fields) -> dict:
    return {"method": "draft", "model": model, "num_speculative_tokens": 4, "disable_by_batch_size": 64,
            "pause_when_slower": False, **fields}


@functools.cache
def plain(arch: str, seed: int) -> list[list[int]]:
    """Greedy output without speculation, the reference (computed once for the tests that share it)."""
    responses, _, _ = generate(tiny_model_dir(arch), repeating_prompts(16, seed=seed), GREEDY,
                               cache_max_entry_count=200)
    return [r.token_ids for r in responses]


def generate_with_draft(arch: str, prompts, gen, **config):
    """``generate`` with the draft's own state checked: nothing kept for a finished sequence."""
    responses, usage, entries = generate(tiny_model_dir(arch), prompts, gen, check_blocks=True, **config)
    return responses, usage, entries


# -- checks before any weight loads -----------------------------------------------------------------

def test_a_draft_that_cannot_draft_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig
    target, draft = tiny_model_dir("llama"), tiny_draft_dir("llama")
    # Another vocabulary (a config of 1,000 tokens).
    other = tmp_path / "other-vocab"
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1)).save_pretrained(other)
    cases = [
        (target, draft_spec(str(other)), {}, "has a vocabulary of 1000 tokens, the target"),
        (draft, draft_spec(target), {}, "is larger than the target"),
        (tiny_model_dir("mistral-sw32"), draft_spec(draft), {}, "every layer slides over 32 tokens"),
        (target, draft_spec(str(tmp_path / "missing")), {}, "speculative.model: model .* is neither a known name"),
    ]
    for model, spec, extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            Engine(model, EngineConfig(device_type="cpu", speculative=spec, **extra))
    with pytest.raises(ConfigError, match=r"num_speculative_tokens must be an int in \[1, 16\]"):
        EngineConfig(device_type="cpu", speculative=draft_spec(draft, num_speculative_tokens=17))


def test_tokenizers_must_agree_token_for_token():
    tok = load_tokenizer(tiny_model_dir("llama"))
    check_same_tokens(tok, load_tokenizer(tiny_draft_dir("llama")), "target", "draft")   # the same: no error

    class Renamed:   # the same size, one token string changed
        def __len__(self):
            return len(tok)

        def convert_ids_to_tokens(self, ids):
            return [t + "!" if i == 5 else t for i, t in zip(ids, tok.convert_ids_to_tokens(ids))]

    with pytest.raises(ConfigError, match="differs from the target 'target''s at 1 of"):
        check_same_tokens(tok, Renamed(), "target", "draft")


# -- greedy token identity ------------------------------------------------------------------------

# The draft is the target's own model class cut to its first layer: Qwen3 (its q/k norms) runs with the slow tests.
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_greedy_identical_to_no_speculation(arch):
    prompts = repeating_prompts(16, seed=3)
    spec, usage, _ = generate_with_draft(arch, prompts, GREEDY, cache_max_entry_count=200,
                                         speculative=draft_spec(tiny_draft_dir(arch)))
    assert [r.token_ids for r in spec] == plain(arch, 3)
    assert all(len(r.token_ids) == 64 for r in spec)
    # Meaningful only with proposals both accepted and rejected.
    assert 0 < usage["spec_accepted_tokens"] < usage["spec_proposed_tokens"]


def test_a_model_drafting_for_itself_has_every_proposal_accepted():
    arch = "llama"
    spec, usage, _ = generate_with_draft(arch, repeating_prompts(16, seed=3), GREEDY, cache_max_entry_count=200,
                                         speculative=draft_spec(tiny_model_dir(arch)))
    assert [r.token_ids for r in spec] == plain(arch, 3)
    assert usage["spec_acceptance_rate"] == 1.0 and usage["spec_pauses"] == 0
    assert usage["spec_mean_acceptance_length"] > 4   # 5 a verification, less where max_tokens cuts a proposal


def test_the_engine_stops_speculating_while_verification_steps_are_slower():
    """A model drafting for itself, its verification made slow on the clock the engine times decode steps
    with (a verifying forward counts 100 plain ones): the engine's timing pauses speculation, and greedy output
    is unchanged; without the check every decode step verifies."""
    model, prompts = tiny_model_dir("llama"), repeating_prompts(1, seed=3)
    gen = GenerationConfig(max_new_tokens=160, ignore_eos=True)
    plain_steps, expected = {}, [r.token_ids for r in generate(model, prompts, gen)[0]]
    for check in (True, False):
        cfg = EngineConfig(device_type="cpu", speculative=draft_spec(model, pause_when_slower=check))
        with lmport.pipeline(model, backend_config=cfg) as pipe:
            execute, now = pipe.engine.executor.execute, [0.0]
            if pipe.engine.speculator.payoff is not None:
                pipe.engine.speculator.payoff.clock = lambda now=now: now[0]

            def slow_verification(step, execute=execute, now=now):
                now[0] += 1.0 if 1 < len(step.token_ids) <= 5 else 0.01   # the prompt is longer
                return execute(step)
            pipe.engine.executor.execute = slow_verification
            out = pipe.generate(prompts, gen)
            usage = pipe.engine.usage()
        assert [r.token_ids for r in out] == expected
        assert (usage["spec_judged_slower"] >= 1) == check
        plain_steps[check] = usage["steps"] - usage["spec_verifications"]   # the prompt's step among them
    assert plain_steps[True] >= Payoff.SAMPLES + Payoff.FIRST_PAUSE   # measured, then paused
    assert plain_steps[False] < Payoff.SAMPLES


def test_greedy_identical_under_preemption():
    # 20 blocks of 16 tokens cannot hold 8 sequences of ~100-155 tokens (66 blocks): the scheduler must preempt,
    # and the draft must recompute a preempted sequence's tokens in its new blocks. Half the prompts of the tests
    # above (each preemption is recomputed), whose reference is computed once.
    spec, usage, _ = generate_with_draft("llama", repeating_prompts(16, seed=3)[:8], GREEDY, cache_max_entry_count=20,
                                         max_prefill_token_num=128,
                                         speculative=draft_spec(tiny_draft_dir("llama")))
    assert usage["preemptions"] > 0 and usage["spec_accepted_tokens"] > 0
    assert [r.token_ids for r in spec] == plain("llama", 3)[:8]


def test_greedy_identical_at_tp2():
    """The target sharded over two ranks, the draft whole on rank 0: greedy output as without speculation at
    tp=2, and both ranks' shared cache leaves the draft its mirror of every block."""
    model, prompts = tiny_model_dir("llama"), repeating_prompts(6, seed=29)
    plain_out, _, _ = generate(model, prompts, GREEDY, tp=2, cache_max_entry_count=100)
    spec, usage, _ = generate(model, prompts, GREEDY, tp=2, cache_max_entry_count=100, check_blocks=True,
                              speculative=draft_spec(tiny_draft_dir("llama")))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain_out]
    assert 0 < usage["spec_accepted_tokens"] < usage["spec_proposed_tokens"], usage


def test_greedy_identical_with_prefix_caching():
    rng = random.Random(9)
    shared = [rng.randrange(3, 40000) for _ in range(40)]
    prompts = [shared + p for p in repeating_prompts(16, seed=7)]
    reference, _, _ = generate(tiny_model_dir("llama"), prompts, GREEDY, cache_max_entry_count=200)
    spec, usage, entries = generate_with_draft("llama", prompts, GREEDY, cache_max_entry_count=200,
                                               enable_prefix_caching=True, max_batch_size=4,
                                               speculative=draft_spec(tiny_draft_dir("llama")))
    assert [r.token_ids for r in spec] == [r.token_ids for r in reference]
    assert usage["prefix_cache_hit_blocks_device"] > 0 and usage["spec_accepted_tokens"] > 0
    texts = [p + r.token_ids for p, r in zip(prompts, spec)]   # no cached block holds a rejected proposal
    for e in entries:
        chain = chain_tokens(e)
        assert any(t[:len(chain)] == chain for t in texts), e


def test_the_draft_reuses_its_blocks_for_a_cached_prefix_and_recomputes_evicted_ones():
    """A model drafting for itself, prefix caching on: a prompt that repeats an earlier request's prompt and answer
    (a second turn) is caught up by the draft from where the target's cache hit ends, not from its start; once
    other requests have taken those blocks, from the start again. Every proposal stays accepted: draft K/V
    taken from a block that no longer held them would make the draft disagree with itself."""
    model, bs = tiny_model_dir("llama"), 16
    rng = random.Random(11)
    first = [rng.randrange(3, 40000) for _ in range(70)]
    others = [[rng.randrange(3, 40000) for _ in range(90)] for _ in range(4)]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    cfg = EngineConfig(device_type="cpu", block_size=bs, cache_max_entry_count=24, enable_prefix_caching=True,
                       speculative=draft_spec(model))
    with lmport.pipeline(model, backend_config=cfg) as pipe:
        engine, caught_up = pipe.engine, []
        forward = engine.draft.runner.forward

        def counting(step, caches):
            if len(step.q_lens) == 1 and step.q_lens[0] > 1:   # a catch-up (proposals are 1 token a row)
                caught_up.append(step.q_lens[0])
            return forward(step, caches)
        engine.draft.runner.forward = counting

        def first_catch_up(prompt):   # the draft's first forward for a request: its prompt, less what it holds
            before = len(caught_up)
            out = pipe.generate([prompt], gen)[0].token_ids
            return caught_up[before], out
        alone, answer = first_catch_up(first)
        second = first + answer + [rng.randrange(3, 40000) for _ in range(5)]   # 99 tokens: 6 whole blocks
        reused, _ = first_catch_up(second)
        for other in others:   # 4 x 114 tokens through a 24-block cache: the first requests' blocks are taken
            pipe.generate([other], gen)
        again, _ = first_catch_up(second)
        usage = engine.usage()
    # A catch-up runs once the prompt's step has added the first token.
    assert alone == len(first) + 1, caught_up
    assert reused <= len(second) + 1 - (len(first) + len(answer)) // bs * bs, caught_up   # the tail after the hit
    assert again == len(second) + 1, caught_up
    assert usage["spec_acceptance_rate"] == 1.0, usage


def test_a_failing_draft_leaves_requests_decoding_without_proposals(monkeypatch):
    from lmport.speculative.draft import DraftModel

    def broken(self, seqs, counts):
        raise RuntimeError("draft forward failed")
    monkeypatch.setattr(DraftModel, "propose", broken)
    prompts = repeating_prompts(4, seed=3)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    reference, _, _ = generate(tiny_model_dir("llama"), prompts, gen, cache_max_entry_count=100)
    # Blocks reserved for the proposals are given back in the same step (checked after every step).
    spec, usage, _ = generate_with_draft("llama", prompts, gen, cache_max_entry_count=100,
                                         speculative=draft_spec(tiny_draft_dir("llama")))
    assert [r.token_ids for r in spec] == [r.token_ids for r in reference]
    assert usage["spec_verifications"] == 0 and all(r.finish_reason == "length" for r in spec)


# -- sampling, state and memory -------------------------------------------------------------------

def test_seeded_sampling_repeats_and_nothing_is_kept_after_the_requests():
    cfg = EngineConfig(device_type="cpu", cache_max_entry_count=100,
                       speculative=draft_spec(tiny_draft_dir("llama")))
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True, do_sample=True, temperature=0.8, top_k=8,
                           random_seed=3)
    runs = []
    for _ in range(2):
        with lmport.pipeline(tiny_model_dir("llama"), backend_config=cfg) as pipe:
            runs.append([r.token_ids for r in pipe.generate(repeating_prompts(3, seed=2), gen)])
            engine = pipe.engine
            assert engine.usage()["spec_verifications"] > 0
            assert engine.draft is not None and not engine.draft._progress   # forgotten at finish
            assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert runs[0] == runs[1] and all(len(t) == 24 for t in runs[0])


def test_the_draft_cache_is_planned_beside_the_target_cache():
    from lmport.memory.budget import draft_bytes_per_block
    from lmport.memory.plan import build_plan
    from lmport.memory.plan_format import format_plan
    from lmport.platform.resolution import resolve_config
    target, draft = tiny_model_dir("llama"), tiny_draft_dir("llama")
    spec = draft_spec(draft)
    alone = build_plan(target, EngineConfig(device_type="cpu"), device_memory=1 << 30)
    report = build_plan(target, EngineConfig(device_type="cpu", speculative=spec), device_memory=1 << 30)
    bpb = report["kv"]["bytes_per_block"]
    # The draft has half the target's layers: its blocks are half the size, and the memory is split 2:1.
    assert report["draft"]["bytes_per_block"] * 2 == bpb
    assert report["draft"]["cache_bytes"] == report["cache"]["num_blocks"] * report["draft"]["bytes_per_block"]
    # The draft's weights come out of the free memory too.
    assert report["free_after_weights_bytes"] == alone["free_after_weights_bytes"] - report["draft"]["weight_bytes"]
    assert report["cache"]["num_blocks"] < alone["cache"]["num_blocks"]
    assert "draft" in format_plan(report)
    # The engine holds what its plan says.
    cfg = EngineConfig(device_type="cpu", cache_max_entry_count=64, speculative=spec)
    assert draft_bytes_per_block(resolve_config(cfg)) == report["draft"]["bytes_per_block"]
    engine = Engine(target, cfg)
    try:
        assert engine.draft is not None
        assert engine.draft.cache_bytes == engine.plan.draft_cache_bytes == 64 * report["draft"]["bytes_per_block"]
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(2400)   # two float32 runs of the default model
def test_default_model_q4_1_drafting_for_its_float_form():
    """The default model's Q4_1 file drafts for its float32 form (the same tokenizer): greedy output as without
    speculation, and most proposals accepted."""
    from support.model_helpers import transformers_dir
    target = str(transformers_dir("smollm2"))
    tok = load_tokenizer("smollm2")
    texts = ["Copy this list: apples, pears, plums, cherries, figs, dates, limes.",
             "def area(r):\n    return 3.14159 * r * r\n\nRewrite the function above with a docstring:\n",
             "The quick brown fox jumps over the lazy dog. The quick brown fox",
             "Summarize: Paged attention stores the KV cache in fixed-size blocks. Summary:"]
    prompts = [tok.encode(t) for t in texts] + repeating_prompts(4, seed=17)
    gen = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    reference, _, _ = generate(target, prompts, gen, cache_max_entry_count=400)
    spec, usage, _ = generate(target, prompts, gen, cache_max_entry_count=400, check_blocks=True,
                              speculative=draft_spec("smollm2"))
    assert [r.token_ids for r in spec] == [r.token_ids for r in reference]
    print(f"acceptance {usage['spec_acceptance_rate']:.3f}, mean acceptance length "
          f"{usage['spec_mean_acceptance_length']:.2f}")
    assert usage["spec_acceptance_rate"] > 0.5
