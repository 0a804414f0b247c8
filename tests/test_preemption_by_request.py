"""Issue 63: a request of many long choices, when the KV cache runs out, takes turns among its own choices rather
than preempting another client's stream (lmport.sched.scheduler.Scheduler.victim).

The tiny model with a cache of 12 blocks of 16 tokens (192 tokens): three choices of 100 tokens and a single
stream of 50, admitted after the choices, cannot all fit. The in-process engine shows the rule step by step; the
HTTP server shows that a request's choices reach the engine as one group (a non-streamed ``n=3`` answer beside a
stream from another client)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.sched.scheduler import Scheduler
from lmport.server.app import create_app
from support.model_helpers import tiny_tool_model_dir
from test_server import ServerThread

CONFIG = EngineConfig(block_size=16, cache_max_entry_count=12, session_len=192)
CHOICE_TOKENS, STREAM_TOKENS = 100, 50


@pytest.fixture
def preempted(monkeypatch) -> list[tuple[str, bool]]:
    """Each preemption: the request id preempted, and whether the lone stream ("alone") was running then."""
    record: list[tuple[str, bool]] = []
    preempt = Scheduler._preempt

    def recording(self, seq):
        record.append((seq.group or "alone", any(s.group is None for s in self.running)))
        preempt(self, seq)
    monkeypatch.setattr(Scheduler, "_preempt", recording)
    return record


def test_the_choices_of_one_request_yield_to_each_other_not_to_another_stream(preempted):
    engine = Engine(tiny_tool_model_dir(), CONFIG)
    try:
        config = GenerationConfig(max_new_tokens=CHOICE_TOKENS, ignore_eos=True)
        choices = [engine.add_request([1, 2, 3, 4], config, group="job") for _ in range(3)]
        for _ in range(5):
            engine.step()
        alone = engine.add_request([5, 6, 7], GenerationConfig(max_new_tokens=STREAM_TOKENS, ignore_eos=True))
        tokens: dict[str, int] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] = len(out.token_ids)
        assert tokens == {**dict.fromkeys(choices, CHOICE_TOKENS), alone: STREAM_TOKENS}
    finally:
        engine.close()
    assert any(stream_running for _, stream_running in preempted), "the stream never ran beside a preemption"
    assert {who for who, _ in preempted} == {"job"}


def test_a_served_requests_choices_are_one_group(preempted):
    engine = Engine(tiny_tool_model_dir(), CONFIG)
    server = ServerThread(create_app(engine, model_name="tiny"))
    try:
        answer: dict = {}

        def choices():
            answer["body"] = httpx.post(server.url + "/v1/completions", timeout=600, json={
                "model": "tiny", "prompt": "a b c", "n": 3, "max_tokens": CHOICE_TOKENS, "ignore_eos": True}).json()
        big = threading.Thread(target=choices)
        big.start()
        deadline = time.monotonic() + 60
        while len(engine.core.scheduler.running) < 3:   # the choices are admitted first: the stream is the newest
            assert time.monotonic() < deadline, "the three choices never ran"
            time.sleep(0.01)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=600, json={
                "model": "tiny", "prompt": "d e", "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        big.join()
    finally:
        server.stop()
    assert json.loads(lines[-1].removeprefix("data: "))["usage"]["completion_tokens"] == STREAM_TOKENS
    assert [c["finish_reason"] for c in answer["body"]["choices"]] == ["length"] * 3
    assert preempted and all(who != "alone" for who, _ in preempted)
