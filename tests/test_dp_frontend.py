"""Data-parallel replicas behind the routing front end, without Ray: two tiny engines in this process
(lmport.dp.cluster.in_process) served over HTTP and asked through the openai client. Replicas as Ray actors
are in tests/test_ray.py (their restarts slow)."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from test_server import ServerThread

from support.model_helpers import tiny_model_dir

from lmport.config import EngineConfig
from lmport.dp import cluster
from lmport.models.loader import load_tokenizer
from lmport.server.app import create_app

CONFIG = EngineConfig(device_type="cpu", cache_max_entry_count=128, enable_prefix_caching=True, block_size=16)


@pytest.fixture(scope="module")
def served():
    front = cluster.in_process(tiny_model_dir("llama"), CONFIG, 2)
    server = ServerThread(create_app(front, model_name="tiny", tokenizer=load_tokenizer(tiny_model_dir("llama"))))
    yield server, front
    server.stop()


def family(name: str, i: int) -> str:
    """Prompts of one family share a long prefix (several KV blocks), then differ."""
    return f"System prompt {name}: " + " ".join(f"rule {name}{k}" for k in range(40)) + f"\nQuestion {i}?"


def replicas(server) -> list[dict]:
    return httpx.get(server.url + "/health").json()["replicas"]


def test_requests_sharing_a_prefix_land_on_one_replica(served):
    server, front = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for i in range(4):
        for name in ("A", "B"):
            out = client.completions.create(model="tiny", prompt=family(name, i), max_tokens=3,
                                            extra_body={"ignore_eos": True})   # a random model may say EOS
            assert out.choices[0].finish_reason == "length"
            if i:
                assert out.usage.prompt_tokens_details.cached_tokens >= 64   # the family's blocks, cached
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content is not None
    routed = [r["routed"] for r in replicas(server)]
    assert sorted(routed) == [4, 5]                     # one family each (and the chat to one of them)
    for status in front.status():
        usage = status["usage"]
        assert usage["prefix_cache_hit_blocks_device"] >= 3 * 4   # three repeats of its family's 4+ blocks
    metrics = httpx.get(server.url + "/metrics").text
    assert 'lmport_replica_healthy{replica="1"} 1.0' in metrics
    assert 'lmport_replica_stat{key="prefix_cache_hit_rate",replica="0"}' in metrics


MAX_TOKENS = 120   # long enough to be in flight when the replica fails


def test_a_failed_replica_ends_its_requests_with_an_error_and_comes_back(served):
    """Replica 1's engine fails while both replicas stream: its requests end with an error naming it, replica
    0's finish; replica 1 is rebuilt and serves again."""
    server, front = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    results: dict[str, list] = {"A": [], "B": []}

    def ask(name, i):
        try:
            out = client.completions.create(model="tiny", prompt=family(name, 10 + i), max_tokens=MAX_TOKENS,
                                            extra_body={"ignore_eos": True})
            results[name].append(("ok", out.usage.completion_tokens))
        except openai.APIStatusError as exc:
            results[name].append((exc.status_code, str(exc)))

    threads = [threading.Thread(target=ask, args=(name, i)) for name in "AB" for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(r["in_flight"] == 2 for r in replicas(server)):
        assert time.monotonic() < deadline, replicas(server)
        time.sleep(0.05)
    names = {front.router.owner[front.router.chain(served_prompt_ids(front, family(n, 10)))[0]]: n for n in "AB"}
    owner_b = next(r for r, n in names.items() if n == "B")
    front.replicas[owner_b].handle.replica.engine.executor.failure = "simulated: a rank died"
    for t in threads:
        t.join(timeout=120)
    failed, kept = names[owner_b], names[1 - owner_b]
    assert results[kept] == [("ok", MAX_TOKENS)] * 2
    assert [r[0] for r in results[failed]] == [500, 500]
    # The replica's engine ended them itself, before the front end saw the replica fail: its error, named.
    assert all(f"data-parallel replica {owner_b}" in r[1] and "simulated" in r[1] for r in results[failed])
    deadline = time.monotonic() + 60
    while not (status := replicas(server)[owner_b])["healthy"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    assert status["restarts"] == 1
    out = client.completions.create(model="tiny", prompt=family(failed, 99), max_tokens=3,
                                        extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"


def served_prompt_ids(front, text: str) -> list[int]:
    """The prompt's token ids as the server makes them (a completion prompt is tokenized as it is)."""
    return front.replicas[0].handle.replica.engine.tokenizer.encode(text)


def test_echo_with_logprobs_scores_the_prompt_on_a_replica(served):
    """Prompt scoring is an ordinary engine request: a replica answers it like any other."""
    server, _ = served
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a b c", "max_tokens": 2,
                                                         "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert logprobs["token_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:prompt_tokens])
    assert len(logprobs["tokens"]) == prompt_tokens + 2


def test_lora_loading_is_refused_saying_why(served):
    server, _ = served
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert r.status_code in (400, 403)
