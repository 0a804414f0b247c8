"""Issue 35's remaining reliability items: prefix-cache isolation (cache_salt, salting by API key), clients that
never read, bounded echo scoring, the grammar mask budget, and bounded prefill steps with admission by choices.
"""
from __future__ import annotations

import json

import httpx
import pytest

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.core import EngineCore
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from support.model_helpers import tiny_model_dir
from test_server import ServerThread


def _wait_while(busy, start: float, limit: float, interval: float = 0.1) -> None:
    """Polls until ``busy()`` is false or ``limit`` seconds have passed since ``start`` (time.monotonic())."""
    import time
    while busy() and time.monotonic() - start < limit:
        time.sleep(interval)

KEYS = ["key-a", "key-b"]
PROMPT = " ".join(f"w{i}" for i in range(200))   # several KV blocks


@pytest.fixture(scope="module")
def cached():
    """Prefix caching on, two API keys, prefix-cache blocks salted by key."""
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=256, session_len=1024,
                                                          block_size=16, enable_prefix_caching=True))
    server = ServerThread(create_app(engine, model_name="tiny", api_key=KEYS, cache_salt_by_api_key=True))
    server.engine = engine
    yield server
    server.stop()


def cached_tokens(server, key: str, **fields) -> int:
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_and_api_key_key_the_prefix_cache(cached):
    cached_tokens(cached, "key-a")
    assert cached_tokens(cached, "key-a") > 0                       # same key, no salt: a hit
    assert cached_tokens(cached, "key-b") == 0                      # another key never hits key-a's blocks
    assert cached_tokens(cached, "key-a", cache_salt="s1") == 0     # a new salt is a new cache
    assert cached_tokens(cached, "key-a", cache_salt="s1") > 0
    assert cached_tokens(cached, "key-b", cache_salt="s1") == 0     # the same salt under another key
    r = httpx.post(cached.url + "/v1/completions", headers={"Authorization": "Bearer key-c"},
                   json={"model": "tiny", "prompt": "a"})
    assert r.status_code == 401
    r = httpx.post(cached.url + "/v1/completions", headers={"Authorization": "Bearer key-a"},
                   json={"model": "tiny", "prompt": "a", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_cache_salt_alone_separates_requests():
    from lmport.engine.client import EngineClient
    from lmport.server.frontend import Frontend
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=64, session_len=512))
    server = Frontend(EngineClient.start_thread(engine), engine.tokenizer, engine.grammars, "tiny")
    try:
        assert server.cache_salt("s", "key-a") == "s" and server.cache_salt(None, None) is None
        server.cache_salt_by_api_key = True
        assert server.cache_salt("s", "key-a") != server.cache_salt("s", "key-b")
        assert server.cache_salt("s", "key-a") != server.cache_salt(None, "key-a")
    finally:
        server.core.shutdown()


def _silent_stream(url: str, body: dict):
    """Sends a streamed request on a socket whose client never reads (and receives into a tiny buffer)."""
    import json
    import socket
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


@pytest.mark.parametrize("limits", [{"send_timeout": 1.0}, {"request_timeout": 3.0, "send_timeout": 600.0}])
def test_a_client_that_never_reads_is_cut_and_frees_its_slots(limits):
    import time
    from lmport.server.limits import Limits
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=256, session_len=4096))
    app = create_app(engine, model_name="tiny", limits=Limits(**limits))
    # Small send buffers: a client that does not read blocks the server's writes after about 100 KB, not megabytes.
    server, state = ServerThread(app, send_buffer=4096), app.state.frontend
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 4000, "ignore_eos": True, "n": 16, "stream": True,
                "logprobs": 5}
        socks = [_silent_stream(server.url, body) for _ in range(2)]
        start = time.monotonic()
        _wait_while(lambda: state.admission.active < 32, start, 30, 0.05)
        assert state.admission.active == 32
        _wait_while(lambda: state.admission.active, start, 40)
        assert state.admission.active == 0, state.admission.active
        _wait_while(lambda: engine.seqs, start, 45)
        assert not engine.seqs
        assert engine.stats["generated_tokens"] < 2 * 16 * 4000   # aborted, not run to max_tokens
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
        for sock in socks:
            sock.close()
    finally:
        server.stop()


@pytest.mark.parametrize("max_unsent", [64 * 1024, 2**40])
def test_a_client_that_never_reads_is_cut_before_the_socket_buffers_fill(max_unsent):
    """The kernel's buffers absorb megabytes before a write waits (so the write timeout alone is late): a client
    that takes none of the waiting output for send_timeout (with any max_unsent_bytes), or leaves more than
    max_unsent_bytes untaken that long, is reset; its requests are aborted and its slots freed."""
    import time

    from lmport.server.connections import ConnectionLimits
    from lmport.server.limits import Limits
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=256, session_len=4096,
                                                          max_batch_size=4))
    # Capacity 4, all taken by the silent request; writes may wait 600 s, so only the unsent bound can cut it.
    app = create_app(engine, model_name="tiny", limits=Limits(send_timeout=600.0, max_waiting_requests=0))
    connections = ConnectionLimits(max_unsent_bytes=max_unsent, send_timeout=1.0)
    server, state = ServerThread(app, **connections.uvicorn_kwargs()), app.state.frontend
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 4000, "ignore_eos": True, "n": 4, "stream": True,
                "logprobs": 5}
        sock = _silent_stream(server.url, body)
        start = time.monotonic()
        _wait_while(lambda: state.admission.active < 4, start, 30, 0.02)
        assert state.admission.active == 4
        _wait_while(lambda: state.admission.active, start, 60)
        assert state.admission.active == 0
        _wait_while(lambda: engine.seqs, start, 60)
        assert not engine.seqs
        assert engine.stats["generated_tokens"] < 4 * 4000   # aborted, not run to max_tokens
        sock.settimeout(10)
        with pytest.raises(ConnectionResetError):   # reset, its unsent output discarded
            while sock.recv(1 << 16):
                pass
        sock.close()
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("samples, reset_at", [
    ([(10, 0)] * 6, 4),                            # output waits, the client takes none (from the 2nd check on)
    ([(10, i) for i in range(6)], None),           # the client takes some every second
    ([(0, 5)] * 6, None),                          # nothing waits
    ([(10, None)] * 6, None),                      # the platform does not say what was taken
    ([(2000 + i, i) for i in range(6)], 3),        # it takes, but the untaken output grows beyond the bound
    ([(5000 - i, i) for i in range(6)], None),     # beyond the bound, but shrinking: a large body being read
])
def test_the_unsent_rules(monkeypatch, samples, reset_at):
    """A connection's check, once a second, on (bytes waiting, bytes the client took): max_unsent_bytes 1000,
    send_timeout 3 s."""
    from typing import Any

    from lmport.server import connections

    class Loop:
        now = 0.0

        def time(self):
            return self.now

        def call_later(self, delay, fn):
            return None

    class Transport:
        aborted = False

        def is_closing(self):
            return self.aborted

        def get_extra_info(self, name):
            return None

        def abort(self):
            self.aborted = True

    proto: Any = object.__new__(connections.HeaderTimeoutH11)
    proto.loop, proto.transport, proto.max_unsent_bytes, proto.unsent_timeout = Loop(), Transport(), 1000, 3.0
    proto._unsent_last, proto._taken_last, proto._idle_since, proto._stalled_since = 0, None, None, None
    reset = None
    for second, (unsent, taken) in enumerate(samples):
        monkeypatch.setattr(connections, "unsent_bytes", lambda transport, unsent=unsent: unsent)
        monkeypatch.setattr(connections, "taken_bytes", lambda transport, taken=taken: taken)
        proto.loop.now = float(second)
        proto._check_unsent()
        if proto.transport.aborted:
            reset = second
            break
    assert reset == reset_at


@pytest.fixture(scope="module")
def plain():
    from lmport.server.limits import Limits
    engine = EngineCore(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=256, session_len=2048))
    app = create_app(engine, model_name="tiny", limits=Limits(request_timeout=4.0))
    server = ServerThread(app)
    server.engine, server.state = engine, app.state.frontend
    yield server
    server.stop()


def test_echo_scoring_is_chunked_and_matches_the_pipeline(plain):
    from lmport.worker import scoring
    from lmport.engine.core import SCORING_LOGITS_BUDGET
    vocab = plain.engine.model_config.vocab_size
    assert plain.engine.scoring_chunk * vocab * 4 <= SCORING_LOGITS_BUDGET
    ids = plain.engine.tokenizer.encode(PROMPT)
    # The pipeline's scoring, on an engine of its own (the served one belongs to the server's core thread).
    reference = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=256, session_len=2048))
    want_lps, want_tops = scoring.token_logprobs(reference, ids, 64, 3)
    reference.close()
    r = httpx.post(plain.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want_lps, abs=1e-4)
    assert plain.engine.block_manager.num_free == plain.engine.block_manager.num_blocks


def _slow_chunks(monkeypatch, engine, counter: list):
    """Scoring in chunks of 4 positions, each step 20 ms slower."""
    import time
    monkeypatch.setattr(engine, "scoring_chunk", 4)
    step = engine.step

    def slow():
        counter.append(1)
        time.sleep(0.02)
        return step()
    monkeypatch.setattr(engine, "step", slow)


def test_echo_scoring_stops_when_the_client_leaves(plain, monkeypatch):
    import socket
    import time
    from urllib.parse import urlsplit
    counter: list = []
    _slow_chunks(monkeypatch, plain.engine, counter)
    chunks = 375
    ids = plain.engine.tokenizer.encode(PROMPT * 4)[:4 * chunks]
    body = json.dumps({"model": "tiny", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}).encode()
    where = urlsplit(plain.url)
    client = socket.create_connection((where.hostname, where.port))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
    _wait_while(lambda: len(counter) < 10, time.monotonic(), 30, interval=0.01)
    client.close()   # the client leaves after 10 of the request's chunks
    blocks = plain.engine.block_manager
    _wait_while(lambda: blocks.num_free != blocks.num_blocks, time.monotonic(), 30, interval=0.01)
    assert blocks.num_free == blocks.num_blocks
    assert 10 <= len(counter) < chunks, len(counter)   # stopped at a chunk after the client left, not the last
    assert httpx.get(plain.url + "/health").status_code == 200


def test_echo_scoring_ends_at_the_request_timeout(plain, monkeypatch):
    import time
    counter: list = []
    _slow_chunks(monkeypatch, plain.engine, counter)
    ids = plain.engine.tokenizer.encode(PROMPT * 8)[:2000]   # 500 chunks, 10 s at least; the timeout is 4 s
    r = httpx.post(plain.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    blocks = plain.engine.block_manager
    _wait_while(lambda: blocks.num_free != blocks.num_blocks, time.monotonic(), 30)
    assert blocks.num_free == blocks.num_blocks
    assert len(counter) < 500   # aborted before its last chunk


AMBIGUOUS = 'root ::= x\nx ::= x x x | x x | "a" | "b" | ""'


def test_a_rule_that_only_repeats_itself_is_refused_before_generation(plain):
    for field in ({"guided_grammar": AMBIGUOUS}, {"grammar": AMBIGUOUS},
                  {"response_format": {"type": "grammar", "grammar": AMBIGUOUS}}):
        r = httpx.post(plain.url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "a", "max_tokens": 2000, **field})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == next(iter(field)) and "is ambiguous" in error["message"], \
            r.text


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time, as a costly grammar does."""
    import time
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class CostlyMasks:
    """A grammar matcher whose every mask costs ``cost`` s of CPU time beside the real one's work: slow by
    construction, so the budget tests do not depend on how fast the grammar engine is on some grammar."""

    def __init__(self, matcher, cost: float):
        self.matcher, self.cost = matcher, cost

    def fill_next_token_bitmask(self, bitmask, row):
        _burn(self.cost)
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


GRAMMAR = "root ::= [a-z]*"   # never has to end: only the budget ends the request


def test_a_grammar_over_its_budget_ends_its_request_as_its_fault_and_never_slows_the_batch(plain, monkeypatch):
    import threading
    from lmport.structured_output import grammar as guided

    class CostlyMatcher(guided.Matcher):   # 20 ms of CPU a mask: a budget of 0.3 s is spent within 16 tokens
        def __init__(self, matcher, budget=guided.GRAMMAR_BUDGET_S):
            super().__init__(CostlyMasks(matcher, 0.02), budget)

    result = {}

    def other():
        result["other"] = httpx.post(plain.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "b", "max_tokens": 60, "ignore_eos": True, "temperature": 0})
    no_end = {str(t): -100 for t in plain.engine.eos_token_ids}
    for _ in range(30):   # the first step loads the CPU kernels (seconds on a loaded machine): not in a request
        warm = httpx.post(plain.url + "/v1/completions", timeout=120, json={"model": "tiny", "prompt": "a",
                                                                            "max_tokens": 2})
        if warm.status_code == 200:
            break
    monkeypatch.setattr(guided, "Matcher", CostlyMatcher)
    monkeypatch.setattr(plain.engine.grammars, "budget", 0.3)   # within the fixture's 4 s request timeout
    thread = threading.Thread(target=other)
    thread.start()
    r = httpx.post(plain.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "a", "max_tokens": 1500, "temperature": 1.0, "seed": 1,
        "guided_grammar": GRAMMAR, "logit_bias": no_end})
    thread.join()
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "format_failed" and error["param"] == "response_format", r.text
    assert error["message"].startswith("response_format: the grammar") and "CPU time" in error["message"], error
    other_r = result["other"]
    assert other_r.status_code == 200 and other_r.json()["usage"]["completion_tokens"] == 60, other_r.text

    # Streamed: the error event names the cause, then [DONE]; the server is fine after.
    with httpx.stream("POST", plain.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "a", "max_tokens": 1500, "temperature": 1.0, "seed": 2, "stream": True,
            "guided_grammar": GRAMMAR, "logit_bias": no_end}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["code"] == "format_failed" and "CPU time" in errors[0]["message"]
    assert httpx.get(plain.url + "/health").status_code == 200
    assert not plain.engine.seqs


def test_a_matcher_over_its_cpu_budget_raises_and_says_why():
    from lmport.structured_output.grammar import GrammarBudgetExceeded, Matcher

    class Costly:   # 10 ms of CPU a call, masks and accepted tokens alike
        def fill_next_token_bitmask(self, bitmask, row):
            _burn(0.01)

        def accept_token(self, token):
            _burn(0.01)
            return True

    matcher = Matcher(Costly(), budget=0.05)
    calls = 0
    with pytest.raises(GrammarBudgetExceeded, match="CPU time"):
        while calls < 100:
            calls += 1
            if calls % 2:
                matcher.fill_next_token_bitmask(None, 0)
            else:
                assert matcher.accept_token(1)
    # Over 0.05 s with the fifth or sixth call: both kinds of call are charged, and nothing before the budget.
    assert matcher.spent > 0.05 and 5 <= calls <= 6, (matcher.spent, calls)


def test_a_row_over_the_mask_budget_is_dropped_from_the_step():
    import threading
    from lmport.structured_output.grammar import MaskBuilder
    stop, finished = threading.Event(), threading.Event()

    class Slow:   # busy on the CPU until the test ends, as an ambiguous grammar's fill is
        def fill_next_token_bitmask(self, bitmask, row):
            import time
            end = time.thread_time() + 10   # bounded, should the step wait for it after all
            while not stop.is_set() and time.thread_time() < end:
                pass
            finished.set()

    class Fast:
        def fill_next_token_bitmask(self, bitmask, row):
            bitmask[row] = 0
            bitmask[row, 0] = 1   # token 0 only

    builder = MaskBuilder(100, budget=0.05)
    try:
        rows, bitmask, overdue = builder.start([Fast(), None, Slow(), Fast()]).result()
        assert not finished.is_set()   # the step went on while the slow fill was still running
    finally:
        stop.set()
    assert rows == [0, 2, 3] and list(overdue) == [2] and "ms" in overdue[2]
    assert bitmask[0].tolist() == [1, 0, 0, 0] and bitmask[3].tolist() == [1, 0, 0, 0]


def test_a_fill_that_waits_for_a_core_is_not_over_the_mask_budget():
    import time
    from lmport.structured_output.grammar import MaskBuilder

    class Descheduled:   # a cheap fill on a loaded machine: long in wall time, little CPU time
        def fill_next_token_bitmask(self, bitmask, row):
            time.sleep(0.3)
            bitmask[row] = -1

    rows, bitmask, overdue = MaskBuilder(100, budget=0.05).start([Descheduled()]).result()
    assert rows == [0] and overdue == {} and bitmask[0].eq(-1).all()


def test_a_format_at_a_dead_end_ends_its_request_not_the_batch():
    from lmport.structured_output.grammar import MaskBuilder

    class DeadEnd:   # what xgrammar fills when no token can continue or end the output
        def fill_next_token_bitmask(self, bitmask, row):
            bitmask[row] = 0

    class Open:
        def fill_next_token_bitmask(self, bitmask, row):
            bitmask[row] = -1

    rows, bitmask, overdue = MaskBuilder(100).start([Open(), DeadEnd()]).result()
    assert rows == [0, 1] and list(overdue) == [1] and "dead end" in overdue[1]
    assert bitmask[0].eq(-1).all()


def test_a_long_prompt_is_prefilled_in_bounded_chunks_while_others_decode():
    """Beside a decoding stream, a prompt's chunks are bounded by the work of decode_prefill_tokens tokens at a
    prompt's start, each token's attention over the positions before it counted: deeper chunks are shorter."""
    from lmport.config import GenerationConfig
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=256, session_len=2048,
                                                          decode_prefill_tokens=64))
    try:
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=400, ignore_eos=True), "stream")
        engine.step()
        engine.step()   # "stream" is decoding now
        engine.add_request(list(range(5, 1205)), GenerationConfig(max_new_tokens=2, ignore_eos=True), "long")
        steps = []
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def record():
            start = engine.seqs["long"].num_computed
            batch = schedule()
            steps.append((start, dict(zip((s.request_id for s in batch.seqs), batch.num_new))))
            return batch
        scheduler.schedule = record
        while "long" in engine.seqs and len(steps) < 200:
            engine.step()
        chunks = [(start, s["long"]) for start, s in steps if "long" in s and start < 1200]   # its prompt
        assert "stream" in engine.seqs and sum(n for _, n in chunks) == 1200, chunks
        assert all(s.get("stream") == 1 for _, s in steps)
        bound = scheduler.prompt_work(0, 64, True)
        assert chunks[0] == (0, 64)
        assert all(scheduler.prompt_work(start, n, True) <= bound + 1e-6 for start, n in chunks)
        for start, n in chunks[:-1]:   # each as long as the bound lets it be; the last one is what was left
            assert bound + 1e-6 < scheduler.prompt_work(start, n + 1, True)
        sizes = [n for _, n in chunks[:-1]]
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 64 / 2, chunks
    finally:
        engine.close()


def test_a_tokens_attention_work_is_what_torch_counts():
    """The scheduler's context cost (a prompt token's attention work per position before it, over its other
    work) against the FLOPs torch's counter finds in the transformers model's forward, at growing lengths."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM
    path = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")   # its matmuls counted

    def flops(length: int) -> int:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.arange(10, 10 + length)[None], logits_to_keep=1)   # a prompt: the head for its last token
        return counter.get_total_flops()

    # flops(L) = head + linear * L + attention * L^2: the counter counts the whole L x L score matrix (causal or
    # not), 4 FLOPs a head dimension a pair, which is a token's work per position before it.
    f1, f2, f3 = flops(64), flops(128), flops(256)
    attention = ((f3 - f2) / 128 - (f2 - f1) / 64) / (256 - 64)
    linear = (f2 - f1) / 64 - attention * (128 + 64)
    engine = Engine(path, EngineConfig(cache_max_entry_count=64, session_len=512))
    try:   # the norms' weights count as weights, not as matrix products: within 1%
        assert engine.scheduler.context_cost == pytest.approx(attention / linear, rel=1e-2)
    finally:
        engine.close()


def test_the_server_bounds_prefill_beside_streams_and_the_offline_engine_does_not():
    """`lmport serve` defaults to SERVE_DECODE_PREFILL_TOKENS; EngineConfig's default (offline use) leaves a step's
    prompt tokens bounded by max_prefill_token_num alone, decoding sequences or not."""
    from lmport.entrypoints.cli import build_parser
    from lmport.config import SERVE_DECODE_PREFILL_TOKENS
    from lmport.entrypoints.flags import engine_config
    from lmport.kv.block_manager import BlockManager
    from lmport.sched.scheduler import Scheduler
    from lmport.sched.sequence import Sequence
    assert engine_config(build_parser().parse_args(["serve"])).decode_prefill_tokens == SERVE_DECODE_PREFILL_TOKENS
    assert engine_config(build_parser().parse_args(["generate", "hi"])).decode_prefill_tokens is None
    for bound, expected in ((SERVE_DECODE_PREFILL_TOKENS, SERVE_DECODE_PREFILL_TOKENS), (None, 256 - 1)):
        scheduler = Scheduler(BlockManager(num_blocks=64, block_size=16), 8, 256, bound)
        stream = Sequence("stream", [1, 2, 3], GenerationConfig(max_new_tokens=8))
        scheduler.add(stream)
        scheduler.schedule()
        stream.num_computed, stream.output_ids = 3, [4]   # its prompt computed, one token sampled: decoding
        scheduler.add(Sequence("long", list(range(5, 605)), GenerationConfig(max_new_tokens=2)))
        batch = scheduler.schedule()
        assert dict(zip((s.request_id for s in batch.seqs), batch.num_new)) == {"stream": 1, "long": expected}


@pytest.mark.parametrize("value", [0, -3, "x", 2.5, True])
def test_a_bad_decode_prefill_bound_is_refused_naming_the_field(value):
    from lmport.errors import ConfigError
    with pytest.raises(ConfigError, match=r"decode_prefill_tokens must be an int >= 1 \(or None for no bound\)"):
        EngineConfig(decode_prefill_tokens=value)


def test_admission_counts_choices():
    from lmport.server.limits import Admission
    from lmport.server.protocol import APIError
    admission = Admission(64)
    releases = [admission.admit(16) for _ in range(4)]   # n = 16: each request takes 16 of the 64
    assert admission.active == 64
    with pytest.raises(APIError) as exc:
        admission.admit(1)
    assert exc.value.status == 503
    releases[0]()
    assert admission.active == 48


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1048576"])
def test_a_bad_max_unsent_bytes_is_refused(value):
    from lmport.errors import ConfigError
    from lmport.server.connections import ConnectionLimits
    with pytest.raises(ConfigError, match="max_unsent_bytes must be a positive int"):
        ConnectionLimits(max_unsent_bytes=value)
