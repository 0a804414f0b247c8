"""What the server holds of a choice's logprobs until its answer is written: ``PackedLogprobs`` (flat arrays, not a
dict a token), read back as the very dicts the engine sent, so the answers are the same bytes as from plain lists
of dicts, whole and streamed, while they take a fraction of the memory."""
from __future__ import annotations

import asyncio
import tracemalloc
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmport.config import GenerationConfig
from lmport.engine.outputs import FinishReason, PackedLogprobs, RequestOutput
from lmport.models.loader import load_tokenizer
from lmport.server import answers, openai_mapping, streaming
from lmport.server.frontend import Job
from lmport.server.metrics import Metrics
from lmport.server.protocol import ChatCompletionRequest, CompletionRequest
from test_server_answer_choices import fake_outputs

logprob = st.floats(max_value=0.0, allow_nan=False)   # -inf too: a token a grammar masks
entry = st.dictionaries(st.integers(0, 2**40), logprob, min_size=1, max_size=22)


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(entry, max_size=12), start=st.integers(-14, 14), stop=st.integers(-14, 14) | st.none(),
       step=st.sampled_from([None, 1, 2, -1]))
def test_packed_entries_read_back_as_the_dicts_given(entries, start, stop, step):
    packed = PackedLogprobs(entries[:len(entries) // 2])
    packed.extend(entries[len(entries) // 2:])
    assert len(packed) == len(entries)
    for i, want in enumerate(entries):
        assert list(packed[i].items()) == list(want.items())   # the same order: ties sort as the engine gave them
        assert packed[i - len(entries)] == want
    assert list(packed[start:stop:step]) == entries[start:stop:step]
    assert isinstance(packed[start:stop:step], PackedLogprobs)
    with pytest.raises(IndexError):
        packed[len(entries)]


def packed(outs: list[RequestOutput]) -> list[RequestOutput]:
    return [RequestOutput(o.request_id, o.token_ids, o.text, [], "", o.finished, o.finish_reason, o.prompt_tokens,
                          o.cached_tokens, PackedLogprobs(o.logprobs)) for o in outs]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def replies(tokenizer, route: str, choices: int, tokens: int, top: int):
    job = Job("x", 1, [[1] * 9], [GenerationConfig(max_new_tokens=tokens, logprobs=top)] * choices, choices, 0.0,
              header={"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"})
    if route == "chat":
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=choices,
                                    logprobs=True, top_logprobs=top, max_tokens=tokens)
        return lambda: openai_mapping.ChatReply(tokenizer, job, req, None)
    req = CompletionRequest(model="m", prompt="hi", n=choices, logprobs=top, max_tokens=tokens)
    return lambda: openai_mapping.CompletionReply(tokenizer, job, req, ["hi"])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_answer_from_packed_logprobs_is_the_same_bytes(tokenizer, route):
    outs = fake_outputs(3, 40, 20, seed=7)
    for o in outs:   # ties among the alternatives: their order decides which of them make the top
        first = next(iter(o.logprobs[0]))
        o.logprobs[0] = {**o.logprobs[0], first + 1: o.logprobs[0][first]}
    reply = replies(tokenizer, route, 3, 40, 20)
    assert answers.joined(reply().body(packed(outs))) == answers.joined(reply().body(outs))
    # and streamed: the chunks from the logprobs not sent yet
    plain, packed_reply = reply(), reply()
    for o, p in zip(outs, packed(outs)):
        for start in (0, 17, 39):
            assert packed_reply.chunks(0, p, "t", start) == plain.chunks(0, o, "t", start)


def test_packed_logprobs_take_a_fraction_of_the_dicts_memory():
    # One choice of the probe's answer: 2048 tokens, each with its 20 alternatives and itself.
    entries = fake_outputs(1, 2048, 20)[0].logprobs
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = PackedLogprobs(entries)
        size = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    count = sum(len(e) for e in entries)
    assert len(held) == 2048
    # 8 bytes an id and 8 a logprob, 8 an end a token, and the arrays' spare room as they grew
    assert size <= (16 * count + 8 * len(entries)) * 9 // 8 + 4096


def test_the_server_keeps_a_choices_logprobs_packed():
    """streaming.collect, the way a whole answer's outputs are gathered, over a core that sends each token's
    logprobs in its own delta, as the engine core does."""
    sent = fake_outputs(2, 30, 5, seed=3)

    class Core:
        async def generate(self, request):
            out = sent[int(request.request_id.rsplit("-", 1)[1])]
            for i, token in enumerate(out.token_ids):
                last = i == len(out.token_ids) - 1
                yield RequestOutput(request.request_id, [], "", [token], "t", last,
                                    FinishReason.LENGTH if last else None, 9, 0, delta_logprobs=[out.logprobs[i]])

    frontend = SimpleNamespace(core=Core(), metrics=Metrics(lambda: None), live=set(),
                               limits=SimpleNamespace(request_timeout=None), engine_problem=lambda: None)
    job = Job("job", 1, [[1] * 9], [GenerationConfig(max_new_tokens=30, logprobs=5)] * 2, 2, 0.0)
    outs = asyncio.run(streaming.collect(frontend, job))
    for got, want in zip(outs, sent, strict=True):
        assert isinstance(got.logprobs, PackedLogprobs)
        assert got.token_ids == want.token_ids and list(got.logprobs) == want.logprobs
