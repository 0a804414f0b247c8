"""Ray: the Ray executor and data-parallel replicas as actors, on a local Ray cluster of this machine (cpu
backend, gloo, tiny models).

In `make test`: tp=2 over Ray gives transformers' greedy tokens (the multiprocess executor's are checked against
the same in tests/test_tensor_parallel.py), and two replicas answer through the OpenAI client with a shared
prefix kept on one of them. The fault cases (a killed rank actor, a killed replica actor and its restart) are
slow. Ray is in the test extra, so a missing Ray fails the run here instead of skipping it.

One cluster serves the module, started with few logical CPUs (the machine's cores are shared) and shut down
when the module ends, so no Ray process outlives the tests.
"""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import ray
from test_dp_frontend import family
from test_server import ServerThread
from test_tensor_parallel import GREEDY, PROMPTS, greedy

from support.model_helpers import hf_greedy, tiny_model_dir

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.models.loader import load_tokenizer
from lmport.server.app import create_app


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    # Ray's memory monitor kills workers when the node's memory is 95% used, by anyone: on a shared machine that
    # would kill these small replicas for other processes' memory and fail the fault tests for no fault of theirs.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_tp2_over_ray_matches_tp1_and_transformers():
    model = tiny_model_dir("llama")
    tokens = {}
    for name, config in (("ray", dict(tp=2, executor="ray")), ("tp1", {})):
        engine = Engine(model, EngineConfig(device_type="cpu", cache_max_entry_count=64, **config))
        try:
            if name == "ray":
                assert engine.executor.pg is not None and len(engine.executor.actors) == 1
            tokens[name] = greedy(engine)
        finally:
            engine.close()
    assert tokens["ray"] == tokens["tp1"] == hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())   # closed: nothing held


@pytest.mark.slow
def test_a_killed_rank_actor_ends_every_request_with_an_error_naming_its_rank():
    engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", tp=2, executor="ray",
                                                          cache_max_entry_count=64))
    try:
        ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
        engine.step()
        engine.executor.kill_rank(1)
        ended = {}
        deadline = time.monotonic() + 60
        while len(ended) < len(ids):
            assert time.monotonic() < deadline
            ended.update({o.request_id: o for o in engine.step() if o.finished})
        assert all(o.finish_reason == "error" and "rank 1 (a Ray actor) died" in o.error for o in ended.values())
        assert engine.failure is not None and "rank 1" in engine.failure
    finally:
        engine.close()


@pytest.fixture(scope="module")
def dp2():
    from lmport.dp import cluster
    config = EngineConfig(device_type="cpu", cache_max_entry_count=128, enable_prefix_caching=True, block_size=16)
    front = cluster.start(tiny_model_dir("llama"), config, 2)
    server = ServerThread(create_app(front, model_name="tiny", tokenizer=load_tokenizer(tiny_model_dir("llama"))))
    yield server, front
    server.stop()


def replicas(server) -> list[dict]:
    return httpx.get(server.url + "/health").json()["replicas"]


def test_dp2_answers_through_openai_and_a_shared_prefix_stays_on_one_replica(dp2):
    server, _ = dp2
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    before = [r["routed"] for r in replicas(server)]   # counted from here: the module's other tests route too
    for i in range(4):
        out = client.completions.create(model="tiny", prompt=family("A", i), max_tokens=3,
                                        extra_body={"ignore_eos": True})   # a random model may say EOS
        assert out.choices[0].finish_reason == "length"
        if i:
            assert out.usage.prompt_tokens_details.cached_tokens >= 64   # the family's blocks, cached
    assert sorted(r["routed"] - b for r, b in zip(replicas(server), before)) == [0, 4]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert all(r["healthy"] for r in replicas(server))


@pytest.mark.slow
def test_killing_a_replica_actor_loses_only_its_requests_and_it_comes_back(dp2):
    server, front = dp2
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    results: dict[str, list] = {"B": [], "C": []}

    def ask(name, i):
        try:
            out = client.completions.create(model="tiny", prompt=family(name, 10 + i), max_tokens=300,
                                            extra_body={"ignore_eos": True})
            results[name].append(("ok", out.usage.completion_tokens))
        except openai.APIStatusError as exc:
            results[name].append((exc.status_code, str(exc)))

    threads = [threading.Thread(target=ask, args=(name, i)) for i in range(2) for name in "BC"]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(r["in_flight"] == 2 for r in replicas(server)):
        assert time.monotonic() < deadline, replicas(server)
        time.sleep(0.05)
    # which replica each family went to (the router's table), before the killed one's entries are dropped
    owner = {name: _owner(server, front, name) for name in "BC"}
    killed = owner["C"]
    ray.kill(front.replicas[killed].handle.actor, no_restart=False)
    for t in threads:
        t.join(timeout=300)
    assert results["B"] == [("ok", 300)] * 2
    assert [r[0] for r in results["C"]] == [500, 500]
    assert all(f"data-parallel replica {killed}" in r[1] for r in results["C"])
    deadline = time.monotonic() + 180
    while not (status := replicas(server)[killed])["healthy"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert status["restarts"] == 1
    out = client.completions.create(model="tiny", prompt=family("C", 99), max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"


def _owner(server, front, name: str) -> int:
    ids = server.server.config.app.state.frontend.tokenizer.encode(family(name, 10))
    return front.router.owner[front.router.chain(ids)[0]]
