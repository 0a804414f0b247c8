"""Requests through the engine: errors fail alone, aborts free blocks, sampling options behave."""
from __future__ import annotations

import functools

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from lmport.engine.engine import RequestError
from support.model_helpers import hf_model, tiny_model_dir


@functools.cache
def tiny_pipe():
    return lmport.pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(
        device_type="cpu", cache_max_entry_count=64, session_len=512))


@functools.cache
def default_pipe():
    return lmport.pipeline("smollm2", backend_config=EngineConfig(device_type="cpu", cache_max_entry_count=256))


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_too_long_prompt_fails_alone_while_others_complete():
    pipe = tiny_pipe()
    good = [ids(10, 1), ids(20, 2), ids(5, 3)]
    out = pipe.generate([good[0], ids(600), good[1], [], good[2]], GenerationConfig(max_new_tokens=4))
    assert [r.finish_reason for r in out] == ["length", "error", "length", "error", "length"]
    assert "600 tokens" in out[1].error and "session_len is 512" in out[1].error
    assert "empty" in out[3].error
    alone = pipe.generate(good, GenerationConfig(max_new_tokens=4))
    assert [r.token_ids for r in alone] == [out[i].token_ids for i in (0, 2, 4)]
    assert pipe.engine.usage()["blocks_used"] == 0


def test_bad_token_ids_are_rejected_with_the_valid_range():
    with pytest.raises(RequestError, match=r"ints in \[0, 49152\)"):
        tiny_pipe().engine.add_request([1, 2, 10**9])


def test_abort_frees_blocks_and_ends_the_request():
    engine = tiny_pipe().engine
    rid = engine.add_request(ids(40), GenerationConfig(max_new_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.usage()["blocks_used"] > 0
    assert engine.abort(rid)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [(rid, "abort", True)]
    assert engine.usage()["blocks_used"] == 0 and not engine.has_unfinished()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    pipe = tiny_pipe()
    cfg = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1.0, top_p=0.9, random_seed=5)
    alone = pipe.generate([ids(9)], cfg)[0].token_ids
    batched = pipe.generate([ids(30, 4), ids(9), ids(3, 6)], cfg)[1].token_ids
    assert alone == batched
    other = pipe.generate([ids(9)], GenerationConfig(max_new_tokens=8, do_sample=True, random_seed=6))[0]
    assert other.token_ids != alone


def test_top_k_one_is_greedy():
    pipe = tiny_pipe()
    greedy = pipe.generate([ids(12)], GenerationConfig(max_new_tokens=6))[0].token_ids
    top1 = pipe.generate([ids(12)], GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, random_seed=1))
    assert top1[0].token_ids == greedy


def test_repetition_penalty_matches_transformers():
    model_dir = tiny_model_dir("llama")
    prompt = ids(16, 9)
    with torch.inference_mode():
        want = hf_model(model_dir).generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                            repetition_penalty=1.5)[0, 16:].tolist()
    got = tiny_pipe().generate([prompt], GenerationConfig(max_new_tokens=10, repetition_penalty=1.5))[0]
    assert got.token_ids == want


def test_stop_token_ids_and_logprobs():
    pipe = tiny_pipe()
    free = pipe.generate([ids(8)], GenerationConfig(max_new_tokens=6, ignore_eos=True))[0].token_ids
    stopped = pipe.generate([ids(8)], GenerationConfig(max_new_tokens=6, stop_token_ids=[free[2]]))[0]
    assert stopped.token_ids == free[:3] and stopped.finish_reason == "stop"
    lp = pipe.generate([ids(8)], GenerationConfig(max_new_tokens=3, logprobs=2))[0]
    assert len(lp.logprobs) == 3
    for token, entry in zip(lp.token_ids, lp.logprobs):
        assert token in entry and len(entry) <= 3 and all(v <= 0 for v in entry.values())
        assert entry[token] == max(entry.values())  # greedy picks the most likely token


def test_chat_prompt_stop_string_and_stream():
    pipe = default_pipe()
    full = pipe("Count from 1 to 10, separated by commas.", GenerationConfig(max_new_tokens=40))
    assert full.finish_reason in ("stop", "length") and full.input_token_len > 5
    assert full.text == pipe.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    assert "".join(pipe.stream("Count from 1 to 10, separated by commas.",
                               GenerationConfig(max_new_tokens=40))) == full.text
    # Cut at a stop string taken from the middle of the model's own text (whatever it wrote): the text stops
    # before the string's first occurrence.
    stop = full.text[len(full.text) // 2:][:3]
    cut = pipe("Count from 1 to 10, separated by commas.", GenerationConfig(max_new_tokens=40, stop_words=[stop]))
    assert len(stop) == 3 and cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    streamed = pipe.stream("Count from 1 to 10, separated by commas.",
                           GenerationConfig(max_new_tokens=40, stop_words=[stop]))
    assert "".join(streamed) == cut.text  # nothing of the stop string was sent and taken back
    batch = pipe(["Hi!", [{"role": "user", "content": "Hi!"}]], GenerationConfig(max_new_tokens=5))
    assert batch[0].token_ids == batch[1].token_ids
    assert pipe([], GenerationConfig()) == []
    bad = pipe([[]], GenerationConfig(max_new_tokens=2))[0]
    assert bad.finish_reason == "error" and "messages list is empty" in bad.error
