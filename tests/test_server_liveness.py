"""/health tells when the engine core stops moving, and nothing a client sends can hold the core's steps.

Issue 63, item 3: with the engine core stopped (SIGSTOP) /health answered 200 while requests hung; a LoRA load
whose adapter_config.json is a FIFO blocked the core's steps; requests had no deadline. Against real
`lmport serve` subprocesses (tests/test_server_reliability.py's hooks hold engine steps where a test needs it):
a core stopped, or a step held, with a request pending turns /health 503 within --engine-stall-timeout and 200
again once it moves; an idle stopped core stays 200; a FIFO adapter config is refused while other requests
run; --request-timeout aborts a request the engine holds.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from test_server_reliability import Serve, _model, assert_recovers

from lmport.lora import AdapterError
from lmport.lora import peft
from lmport.lora.reads import AdapterReads

STALL = 2.0        # --engine-stall-timeout of the test server, seconds
DEADLINE = 2.0     # --request-timeout of the deadline server
WAIT = 60          # a guard against hangs, never what a test measures


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("liveness")
    started = {"stall": Serve(tmp, "stall", "--engine-stall-timeout", str(STALL), "--enable-lora-loading",
                              "--max-loras", "1"),
               "deadline": Serve(tmp, "deadline", "--request-timeout", str(DEADLINE))}
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module")
def stall(servers):
    return servers["stall"].ready()


@pytest.fixture(scope="module")
def deadline(servers):
    return servers["deadline"].ready()


def core_process(server) -> psutil.Process:
    front_end = psutil.Process(server.proc.pid)
    (core,) = [p for p in front_end.children() if p.cmdline() == front_end.cmdline()]   # forked from it
    return core


@pytest.fixture
def stopped_core(stall):
    """Stops the stall server's engine core (SIGSTOP) for the test; yields a function that resumes it."""
    core = core_process(stall)
    core.send_signal(signal.SIGSTOP)
    resume = lambda: core.send_signal(signal.SIGCONT)   # noqa: E731
    try:
        yield resume
    finally:
        resume()


def health_becomes(url: str, status: int, within: float) -> httpx.Response:
    """/health polled until it answers ``status``; fails after ``within`` seconds (a hang guard)."""
    deadline = time.monotonic() + within
    while True:
        r = httpx.get(url + "/health", timeout=WAIT)
        if r.status_code == status:
            return r
        assert time.monotonic() < deadline, f"/health still {r.status_code} {r.text}"
        time.sleep(0.1)


def completion(url: str, **fields) -> dict:
    return {"model": _model(url), "prompt": "hello", "max_tokens": 4, "ignore_eos": True, **fields}


def test_a_stopped_core_with_a_request_pending_turns_health_503_until_it_resumes(stall, stopped_core):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, stall.url + "/v1/completions", json=completion(stall.url), timeout=WAIT)
        r = health_becomes(stall.url, 503, STALL + WAIT)
        body = r.json()
        assert "not progressing" in body["reason"] and body["since"], body
        stopped_core()
        health_becomes(stall.url, 200, WAIT)
        assert pending.result().status_code == 200, pending.result().text


def test_an_idle_stopped_core_stays_healthy(stall, stopped_core):
    end = time.monotonic() + 2 * STALL + 1
    while time.monotonic() < end:
        r = httpx.get(stall.url + "/health", timeout=WAIT)
        assert r.status_code == 200, r.text
        time.sleep(0.2)


def test_a_held_step_turns_health_503_and_back(stall):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with stall.hold("steps") as reached:
            pending = pool.submit(httpx.post, stall.url + "/v1/completions", json=completion(stall.url),
                                  timeout=WAIT)
            reached()
            assert "not progressing" in health_becomes(stall.url, 503, STALL + WAIT).json()["reason"]
        health_becomes(stall.url, 200, WAIT)
        assert pending.result().status_code == 200, pending.result().text
    assert_recovers(stall.url)


def test_a_fifo_adapter_config_is_refused_while_other_requests_run(stall, tmp_path):
    adapter = tmp_path / "fifo-adapter"
    adapter.mkdir()
    os.mkfifo(adapter / "adapter_config.json")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(httpx.post, stall.url + "/v1/load_lora_adapter", timeout=WAIT,
                           json={"lora_name": "fifo", "lora_path": str(adapter)})
        r = httpx.post(stall.url + "/v1/completions", json=completion(stall.url), timeout=WAIT)
        assert r.status_code == 200, r.text
        refused = load.result()
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "could not be loaded" in message and str(tmp_path) not in message, message
    assert "fifo" not in httpx.get(stall.url + "/v1/models", timeout=WAIT).text
    assert httpx.get(stall.url + "/health", timeout=WAIT).status_code == 200


def test_a_request_deadline_aborts_a_request_the_engine_holds(deadline):
    with deadline.hold("steps") as reached:
        box = {}
        plain = threading.Thread(target=lambda: box.update(r=httpx.post(
            deadline.url + "/v1/completions", json=completion(deadline.url), timeout=WAIT)))
        plain.start()
        reached()
        with httpx.stream("POST", deadline.url + "/v1/completions", timeout=WAIT,
                          json=completion(deadline.url, stream=True)) as s:
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
        plain.join(WAIT)
    assert box["r"].status_code == 504 and box["r"].json()["error"]["code"] == "timeout", box["r"].text
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout", events
    assert_recovers(deadline.url)   # both were aborted in the engine: nothing left running


# -- the adapter config read, bounded -------------------------------------------------------------------------

def _read_config_guarded(path) -> Exception | None:
    """read_config's error, run on a thread so that a read that blocks fails the test instead of hanging it."""
    box = {}

    def run():
        try:
            peft.read_config(path)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT / 4)
    assert not t.is_alive(), "reading the adapter config blocked"
    return box.get("error")


def test_read_config_refuses_a_fifo_and_an_oversized_file(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / peft.CONFIG_FILE)
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / peft.CONFIG_FILE).write_text('{"r": 8, "pad": "' + "x" * (peft.MAX_CONFIG_BYTES + 1) + '"}')
    for path, why in ((fifo, "not a regular file"), (huge, "larger than")):
        error = _read_config_guarded(path)
        assert isinstance(error, AdapterError) and why in str(error), error
        assert "could not be loaded" in str(error) and str(tmp_path) not in str(error), error


def test_an_adapter_read_that_never_ends_is_answered_and_reads_are_bounded():
    release = threading.Event()
    reads = AdapterReads(lambda path: release.wait(WAIT), timeout=0.2, limit=1)
    reads.start("call-1", "stuck", "/some/path")
    with pytest.raises(AdapterError, match="too many adapter loads"):
        reads.start("call-2", "next", "/other/path")
    deadline = time.monotonic() + WAIT
    while not (done := reads.finished()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ((key, args, adapter, error),) = done
    assert (key, args, adapter) == ("call-1", ("stuck", "/some/path"), None), done
    assert "could not be loaded" in str(error) and "/some/path" not in str(error), error
    assert not reads.busy()
    release.set()   # the stuck read ends: its slot is free again
    deadline = time.monotonic() + WAIT
    while True:
        try:
            reads.start("call-3", "next", "/other/path")
            break
        except AdapterError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert reads.busy()
