"""Issue 63, item 1: a whole (non-streamed) answer is made a choice at a time as it is written, never held whole.

A non-streamed chat answer with n=16, 2048 tokens and 20 top logprobs is a dict per token and alternative:
built whole before it was encoded, it held several times its JSON text in Python objects. Its choices (and a
chat choice's logprobs, a token at a time) are now ``answers.Each``: made as ``answers.pieces`` writes them and
dropped once written. These tests check that the bytes are exactly those of the whole answer encoded as
Starlette's JSONResponse encodes it (what the routes sent before), on real answers of the chat and completions
routes, and that encoding an answer holds little more than its JSON text.
"""
from __future__ import annotations

import random
import tracemalloc

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from lmport.config import GenerationConfig
from lmport.engine.outputs import FinishReason, RequestOutput
from lmport.models.loader import load_tokenizer
from lmport.server import answers, openai_mapping
from lmport.server.answers import Each
from lmport.server.frontend import Job
from lmport.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from test_server import tool_model_server


def whole(value):
    """``value`` with every Each made into its list: the answer as it was built before it was encoded."""
    if isinstance(value, Each):
        return [whole(item) for item in value]
    if isinstance(value, dict):
        return {key: whole(item) for key, item in value.items()}
    if isinstance(value, list):
        return [whole(item) for item in value]
    return value


# -- Each ------------------------------------------------------------------------------------------------------

scalar = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
          | st.text(max_size=6))
nested = st.recursive(scalar, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=40)


def each_of(items: list) -> Each:
    return Each(len(items), lambda i: items[i])


@settings(max_examples=150, deadline=None)
@given(items=st.lists(nested, max_size=12), piece=st.sampled_from([1, 8, 64, 1 << 16]))
def test_an_each_is_written_as_the_list_of_its_items(items, piece):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answers, "PIECE", piece)
        assert answers.joined({"choices": each_of(items), "n": len(items)}) == \
            JSONResponse({"choices": items, "n": len(items)}).body


def nested_in_lists(value, depth: int = answers.OPENED_DEPTH + 2):
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("value, expected", [
    (Each(0, lambda i: i), []),
    ({1: Each(2, lambda i: [i])}, {1: [[0], [1]]}),                          # a dict with a key json converts
    (nested_in_lists(Each(3, str)), nested_in_lists(["0", "1", "2"])),      # deeper than pieces opens
])
def test_an_each_inside_a_value_written_whole_is_written_as_its_list(value, expected):
    assert answers.joined(value) == JSONResponse(expected).body


def test_an_eachs_items_are_made_once_each_in_order():
    made: list[int] = []

    def make(i: int) -> dict:
        made.append(i)
        return {"index": i, "values": list(range(50))}

    assert answers.joined(Each(40, make)) == JSONResponse([make(i) for i in range(40)]).body
    assert made == list(range(40)) * 2


# -- real answers: the bytes of the whole answer -----------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    server = tool_model_server()
    yield server
    server.stop()


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """The reply and the final outputs each whole answer was made from."""
    seen: dict = {}
    for cls in (openai_mapping.ChatReply, openai_mapping.CompletionReply):
        def recording(self, outs, build=cls.body):
            seen.update(reply=self, outs=outs)
            return build(self, outs)
        monkeypatch.setattr(cls, "body", recording)
    return seen


@pytest.mark.parametrize("path, body, logprob_entries", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
                              "n": 3, "max_tokens": 24, "temperature": 1.0, "seed": 5}, 24),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 8}, None),
    ("/v1/completions", {"prompt": "hi there", "logprobs": 5, "n": 3, "max_tokens": 16, "temperature": 1.0,
                         "seed": 2}, 16),
    ("/v1/completions", {"prompt": ["hi there", "a b c"], "logprobs": 3, "echo": True, "n": 2, "max_tokens": 6},
     None),
])
def test_a_whole_answer_is_the_json_of_the_answer_built_whole(server, recorded, monkeypatch, path, body,
                                                              logprob_entries):
    monkeypatch.setattr(answers, "PIECE", 256)   # small pieces: every choice and logprobs list is sliced
    r = httpx.post(server.url + path, json={"model": "tiny", "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    built = whole(recorded["reply"].body(recorded["outs"]))
    assert r.content == JSONResponse(built).body
    choices = built["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices))) and len(choices) == len(recorded["outs"])
    if logprob_entries is not None:
        for c in choices:
            lps = c["logprobs"]
            assert len(lps["content"] if "content" in lps else lps["tokens"]) == logprob_entries


def test_a_failed_choice_fails_the_answer_before_any_of_it_is_written():
    job = Job("x", 1, [[1, 2]], [GenerationConfig()] * 2, 2, 0.0, header={"id": "chatcmpl-x"})
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
    good = RequestOutput("a", [5], "a", [], "", True, FinishReason.STOP, 2)
    bad = RequestOutput("b", [], "", [], "", True, FinishReason.ERROR, 2, error="boom")
    with pytest.raises(APIError) as failed:
        openai_mapping.ChatReply(None, job, req, None).body([good, bad])
    assert failed.value.status == 500 and "boom" in str(failed.value)


# -- the probe's shape: held memory ------------------------------------------------------------------------------

def fake_outputs(choices: int, tokens: int, top: int, seed: int = 0) -> list[RequestOutput]:
    """Finished outputs as the engine gives them: each token's logprobs with ``top`` alternatives."""
    rng = random.Random(seed)
    outs = []
    for c in range(choices):
        ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
        entries = [{**{rng.randrange(1000, 40000): -rng.random() * 9 for _ in range(top)}, t: -rng.random()}
                   for t in ids]
        outs.append(RequestOutput(f"r{c}", ids, f"text {c}", [], "", True, FinishReason.LENGTH, 9, 0, entries))
    return outs


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_big_answer_holds_little_more_than_its_json_text_while_it_is_encoded(route):
    # The probe's n=16 with 20 top logprobs, at 256 tokens a choice: built whole, its objects held about ten
    # times its JSON text (chat) at once.
    choices, tokens, top = 16, 256, 20
    tokenizer = load_tokenizer("smollm2")
    outs = fake_outputs(choices, tokens, top)
    job = Job("x", 1, [[1] * 9], [GenerationConfig(max_new_tokens=tokens, logprobs=top)] * choices, choices, 0.0,
              header={"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"})
    if route == "chat":
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=choices,
                                    logprobs=True, top_logprobs=top, max_tokens=tokens)
        reply = openai_mapping.ChatReply(tokenizer, job, req, None)
    else:
        req = CompletionRequest(model="m", prompt="hi", n=choices, logprobs=top, max_tokens=tokens)
        reply = openai_mapping.CompletionReply(tokenizer, job, req, ["hi"])
    for token_id in {t for o in outs for e in o.logprobs for t in e}:   # the tokenizer's own caches, filled first
        tokenizer.decode([token_id])
    tracemalloc.start()
    try:
        content = answers.joined(reply.body(outs))
        held = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert content == JSONResponse(whole(reply.body(outs))).body
    one_choice = len(content) // choices
    # The text, once, and what one choice (at most) takes while it is written.
    assert held < len(content) * 9 // 8 + 4 * one_choice + 2 * answers.PIECE, (held, len(content))
