"""The output processor (lmport.engine.output_processor): the core's token-only outputs to text, as the engine made them
when it detokenized and checked stop strings itself (``engine_push`` below is that code), one token at a time or
several in one output (speculative decoding); and under the server, a stop string ends the stream at once and
aborts the request in the engine core."""
from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from lmport.engine import detokenize
from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine, RequestOutput
from lmport.models.loader import load_tokenizer
from lmport.engine.output_processor import OutputProcessor
from lmport.server.app import create_app
from support.model_helpers import tiny_model_dir
from test_server import ServerThread

TEXT = "Hello world, this is a test of stop strings: naïve café 🚀 done."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def engine_push(tokenizer, tokens: list[int], gen: GenerationConfig, core_end: str | None):
    """What the engine gave for ``tokens`` appended one by one before the output processor existed:
    [(token, delta text)] up to the token that ended it, its text and finish reason. ``core_end``: how the
    core ends the request at the last token ("stop": a stop token, "length"), or None."""
    decoder = detokenize.IncrementalDecoder(tokenizer, gen.skip_special_tokens)
    ids, shown, steps = [], "", []
    for i, token in enumerate(tokens):
        ids.append(token)
        old_text, text = shown, decoder.update(ids)
        last = i == len(tokens) - 1
        reason = cut = None
        if last and core_end == "stop":
            reason = "stop"
        elif gen.stop_words and (cut := detokenize.first_stop(text, gen.stop_words, len(old_text))) is not None:
            text, reason = text[:cut], "stop"
        elif last and core_end == "length":
            reason = "length"
        if reason:
            if cut is None:
                text = detokenize.decode(tokenizer, ids, skip_special_tokens=gen.skip_special_tokens)
            shown = text
            steps.append((token, detokenize.final_delta(text, old_text)))
            return steps, shown, reason
        delta = detokenize.streamable_delta(text, old_text, gen.stop_words)
        shown = old_text + delta
        steps.append((token, delta))
    return steps, shown, None


def core_output(tokens: list[int], reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", [], "", list(tokens), "", reason is not None, reason, 3,
                         delta_logprobs=[{t: -0.5} for t in tokens])


def run(tokenizer, chunks: list[list[int]], gen: GenerationConfig, core_end: str | None, cumulative=True):
    """The processor's outputs for the core's ``chunks`` of tokens (the last one ending with ``core_end``) and
    those it reported ended; it stops being fed once an output is finished."""
    processor = OutputProcessor(tokenizer, cumulative=cumulative)
    processor.add("r", gen)
    outs, ended = [], []
    for i, chunk in enumerate(chunks):
        got, stopped = processor.process([core_output(chunk, core_end if i == len(chunks) - 1 else None)])
        outs += got
        ended += stopped
        if got and got[-1].finished:
            break
    assert bool(processor.requests) is not outs[-1].finished   # a finished request's state is dropped
    return outs, ended


def check_like_the_engine(tokenizer, tokens, chunks, gen, core_end):
    """The processor's outputs against engine_push's, chunk for chunk."""
    steps, text, reason = engine_push(tokenizer, tokens, gen, core_end)
    outs, ended = run(tokenizer, chunks, gen, core_end)
    assert "".join(o.delta_text for o in outs) == "".join(d for _, d in steps)
    assert [t for o in outs for t in o.delta_token_ids] == [t for t, _ in steps]
    # Each output's text is what its chunk's tokens added, one by one, as the engine's _append_all did.
    deltas = iter(d for _, d in steps)
    for out in outs:
        assert out.delta_text == "".join(next(deltas) for _ in out.delta_token_ids)
        assert len(out.delta_logprobs) == len(out.delta_token_ids)
    last = outs[-1]
    assert (last.finished, last.finish_reason) == (reason is not None, reason)
    if reason is not None:
        assert last.text == text and last.token_ids == [t for t, _ in steps]
        assert len(last.logprobs) == len(last.token_ids)
    # Reported ended (for the caller to abort in the core) only when it ended in an output the core had not ended.
    ends = [sum(len(c) for c in chunks[:i + 1]) for i in range(len(chunks))]
    in_last = next(i for i, end in enumerate(ends) if end >= len(steps)) == len(chunks) - 1
    core_finished = core_end is not None and in_last
    assert [o.request_id for o in ended] == (["r"] if reason is not None and not core_finished else [])
    return outs


def chunked(tokens: list[int], sizes) -> list[list[int]]:
    chunks, i = [], 0
    for n in sizes:
        if i >= len(tokens):
            break
        chunks.append(tokens[i:i + n])
        i += n
    if i < len(tokens):
        chunks.append(tokens[i:])
    return chunks


def test_a_stop_string_split_across_tokens_cuts_the_text(tokenizer):
    tokens = tokenizer.encode(TEXT)
    gen = GenerationConfig(stop_words=["is a te"])
    outs = check_like_the_engine(tokenizer, tokens, [[t] for t in tokens], gen, "length")
    last = outs[-1]
    assert last.finish_reason == "stop" and last.text == TEXT[:TEXT.index("is a te")]
    assert "is a te" in tokenizer.decode(last.token_ids) and "is a te" not in tokenizer.decode(last.token_ids[:-1])
    assert "".join(o.delta_text for o in outs) == last.text   # nothing of the stop string was shown


def test_a_stop_string_inside_a_speculative_output(tokenizer):
    """Several tokens in one output: the stop string completes at one in the middle; the tokens after it are
    dropped, and the text is as if they had come one by one."""
    tokens = tokenizer.encode(TEXT)
    gen = GenerationConfig(stop_words=["test of"])
    whole = check_like_the_engine(tokenizer, tokens, [[t] for t in tokens], gen, "length")[-1]
    for size in (2, 3, 5):
        outs = check_like_the_engine(tokenizer, tokens, chunked(tokens, [size] * len(tokens)), gen, "length")
        assert (outs[-1].text, outs[-1].token_ids) == (whole.text, whole.token_ids)


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    tokens = tokenizer.encode("Hello world, hello there")
    gen = GenerationConfig(stop_words=["world peace"])   # "world" may start it until ", " says not
    outs = check_like_the_engine(tokenizer, tokens, [[t] for t in tokens], gen, None)
    shown = [""]
    for out in outs:
        shown.append(shown[-1] + out.delta_text)
    assert "Hello " in shown and not any(s.endswith("world") for s in shown)
    assert shown[-1] == "Hello world, hello there"


def test_a_partial_last_character_is_decoded_at_the_end(tokenizer):
    tokens = tokenizer.encode("go 🚀")[:-1]   # the emoji's last byte never comes
    gen = GenerationConfig()
    outs = check_like_the_engine(tokenizer, tokens, [[t] for t in tokens], gen, "length")
    assert outs[-1].text == tokenizer.decode(tokens) and outs[-1].text.endswith("\ufffd")
    assert "\ufffd" not in "".join(o.delta_text for o in outs[:-1])   # held back while running


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_shown(tokenizer, skip):
    tokens = tokenizer.encode("one two") + [tokenizer.eos_token_id] + tokenizer.encode(" three")
    gen = GenerationConfig(skip_special_tokens=skip)
    outs = check_like_the_engine(tokenizer, tokens, [[t] for t in tokens], gen, "length")
    assert outs[-1].text == tokenizer.decode(tokens, skip_special_tokens=skip)
    assert (tokenizer.eos_token in outs[-1].text) is not skip


def test_a_stop_token_is_not_searched_for_a_stop_string(tokenizer):
    """The core ended it on a stop token: the whole output is its text, as the engine checked the stop token first."""
    tokens = tokenizer.encode("abc def")
    outs = check_like_the_engine(tokenizer, tokens, [[t] for t in tokens], GenerationConfig(stop_words=["def"]), "stop")
    assert outs[-1].text == "abc def"


def test_random_streams_and_chunks_match_the_engine(tokenizer):
    rng = random.Random(0)
    base = tokenizer.encode(TEXT)
    for _ in range(40):
        tokens = [rng.choice(base) if rng.random() < 0.8 else rng.randrange(len(tokenizer)) for _ in range(30)]
        text = tokenizer.decode(tokens)
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 6)].strip() or "zz"
        gen = GenerationConfig(stop_words=[stop, "never here"], skip_special_tokens=rng.random() < 0.8)
        chunks = chunked(tokens, [rng.randint(1, 4) for _ in tokens])
        check_like_the_engine(tokenizer, tokens, chunks, gen, rng.choice(["length", "stop", None]))


def test_deltas_only_for_a_server_stream(tokenizer):
    tokens = tokenizer.encode(TEXT)
    outs, _ = run(tokenizer, [[t] for t in tokens], GenerationConfig(), "length", cumulative=False)
    assert all(o.token_ids == [] and o.logprobs == [] for o in outs)
    assert outs[-1].text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_decoding_failure_ends_the_request_with_an_error(tokenizer, monkeypatch):
    processor = OutputProcessor(tokenizer, cumulative=True)
    processor.add("r", GenerationConfig())

    def broken(ids, **kw):
        raise ValueError("broken decode")

    monkeypatch.setattr(tokenizer, "decode", broken)
    (out,), (ended,) = processor.process([core_output([5])])
    assert (out.finished, out.finish_reason, out.error) == (True, "error", "decoding failed: ValueError: broken decode")
    assert ended is out and not processor.requests


def test_outputs_of_requests_it_does_not_hold_are_dropped(tokenizer):
    """The core's last output of a request a stop string ended (its abort) reaches no caller."""
    tokens = tokenizer.encode("a b c")
    processor = OutputProcessor(tokenizer, cumulative=False)
    processor.add("r", GenerationConfig(stop_words=["b"]))
    outs, ended = processor.process([core_output(tokens)])
    assert outs[0].finish_reason == "stop" and ended == outs
    assert processor.process([core_output([], "abort")]) == ([], [])


# -- under the server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=64))
    server = ServerThread(create_app(engine, model_name="tiny"))
    server.engine = engine
    yield server
    server.stop()


def stream(url: str, body: dict) -> tuple[str, list[str | None]]:
    text, reasons = "", []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reasons.append(choice["finish_reason"])
    return text, reasons


def test_a_stop_string_ends_the_stream_and_aborts_the_request_in_the_core(tiny):
    body = {"model": "tiny", "prompt": "a b c", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full, _ = stream(tiny.url, body)
    stop = next(s for i in range(len(full) // 3, len(full)) if (s := full[i:i + 3]).strip() and "\ufffd" not in s)
    engine = tiny.engine
    before = engine.stats["generated_tokens"]
    # Long enough that the core would run for seconds past the stop string if nothing aborted it.
    text, reasons = stream(tiny.url, {**body, "max_tokens": 2000, "stop": [stop]})
    assert text == full[:full.index(stop)] and reasons[-1] == "stop"
    deadline = time.monotonic() + 60   # a hang guard
    while engine.seqs and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.seqs   # aborted in the core: its blocks are free
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert engine.stats["generated_tokens"] - before < 200


def test_echo_with_a_stop_string_keeps_the_prompt_scores(tiny):
    """The prompt's logprobs reach a request that a stop string ends before the core ends it."""
    body = {"model": "tiny", "prompt": "a b c", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = httpx.post(tiny.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    stop = next(s for i in range(len(full) // 3, len(full)) if (s := full[i:i + 3]).strip() and "\ufffd" not in s)
    r = httpx.post(tiny.url + "/v1/completions", timeout=60,
                   json={**body, "max_tokens": 2000, "stop": [stop], "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"].endswith(full[:full.index(stop)])
    logprobs, generated = choice["logprobs"], r.json()["usage"]["completion_tokens"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == r.json()["usage"]["prompt_tokens"] + generated
    assert logprobs["token_logprobs"][0] is None and None not in logprobs["token_logprobs"][1:]
