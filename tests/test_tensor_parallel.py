"""Tensor parallelism on the cpu backend over gloo: the same greedy tokens as tp=1 and transformers.

Each tp engine starts worker processes (seconds on a small machine), so one engine is
shared by several tests (a process runs one tensor-parallel engine at a time); the default model at tp=3,
the command-line paths and two nodes are marked slow.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from support.model_helpers import default_model_path, hf_greedy, tiny_model_dir

from lmport import plan, plan_format
from lmport.config import ConfigError, EngineConfig, GenerationConfig
from lmport.engine import Engine
from lmport.server.app import create_app

PROMPTS = [[1] + list(range(100 + 7 * i, 120 + 13 * i)) for i in range(4)]
GREEDY = GenerationConfig(max_new_tokens=12, ignore_eos=True)


def greedy(engine: Engine, prompts=PROMPTS, gen=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, gen) for p in prompts]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_tp4_with_replicated_kv_heads_matches_transformers():
    """4 attention heads and 2 KV heads over 4 ranks: each KV head replicated on two ranks."""
    engine = Engine(tiny_model_dir("qwen2"), EngineConfig(device_type="cpu", tp=4, cache_max_entry_count=64))
    try:
        assert engine.layout.num_kv_heads == 1 and engine.runner.model.model.layers[0].self_attn.num_heads == 1
        tokens = greedy(engine)
    finally:
        engine.close()
    assert tokens == hf_greedy(tiny_model_dir("qwen2"), PROMPTS, GREEDY.max_new_tokens)


QUANT_PREFIX = dict(device_type="cpu", quant_policy=8, enable_prefix_caching=True, host_cache_gib=0.01,
                    cache_max_entry_count=12)


def shared_prefix_prompts() -> list[list[int]]:
    prefix = list(range(1000, 1064))     # four full blocks every prompt shares
    return [[1] + prefix + list(range(200 + 9 * i, 210 + 9 * i)) for i in range(4)]


def run_prefix_workload(engine: Engine) -> list[list[int]]:
    """One prompt at a time, then one that evicts the cached blocks to the host, then the first again."""
    prompts = shared_prefix_prompts()
    tokens = [greedy(engine, [p])[0] for p in prompts + prompts[:1]]
    tokens += [greedy(engine, [list(range(3000, 3150))])[0], greedy(engine, prompts[:1])[0]]
    return tokens


def test_quant_policy_8_and_prefix_caching_with_host_tier_match_tp1():
    results, stats = [], []
    for tp in (2, 1):
        engine = Engine(tiny_model_dir("qwen3"), EngineConfig(tp=tp, **QUANT_PREFIX))
        try:
            results.append(run_prefix_workload(engine))
            stats.append(dict(engine.block_manager.stats))
        finally:
            engine.close()
    assert results[0] == results[1]
    assert stats[0]["lookup_device"] > 0 and stats[0]["lookup_host"] > 0   # both tiers were hit


@pytest.fixture(scope="module")
def llama_tp2():
    engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", tp=2, cache_max_entry_count=64))
    yield engine
    engine.close()


def test_tp2_tokens_match_tp1_and_transformers(llama_tp2):
    engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", cache_max_entry_count=64))
    try:
        tp1 = greedy(engine)
    finally:
        engine.close()
    assert greedy(llama_tp2) == tp1 == hf_greedy(tiny_model_dir("llama"), PROMPTS, GREEDY.max_new_tokens)


def test_get_ppl_runs_through_the_ranks(llama_tp2):
    from lmport.api import Pipeline
    pipe = Pipeline.__new__(Pipeline)          # a Pipeline over the shared engine
    pipe.engine, pipe.tokenizer = llama_tp2, llama_tp2.tokenizer
    tp2 = pipe.get_ppl([PROMPTS[0]], logits_budget_bytes=8 * 49152 * 4)   # chunks of 8 positions
    pipe.engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", cache_max_entry_count=64))
    try:
        tp1 = pipe.get_ppl([PROMPTS[0]], logits_budget_bytes=8 * 49152 * 4)
    finally:
        pipe.engine.close()
    assert tp2 == pytest.approx(tp1, rel=1e-5)


def test_a_killed_worker_ends_every_request_with_an_error_naming_its_rank(llama_tp2):
    """Runs last of the llama_tp2 tests: it breaks the shared engine. Bound: each request ends within
    30 s of the kill (the collective fails at once; 30 s leaves room for a loaded machine)."""
    engine = llama_tp2
    pids = list(engine.executor.worker_pids.values())
    client = TestClient(create_app(engine))
    assert client.get("/health").status_code == 200
    results = []

    def ask(i):
        r = client.post("/v1/completions", json={"model": engine.model_name, "prompt": f"count {i}",
                                                 "max_tokens": 200, "ignore_eos": True})
        results.append((r.status_code, r.json(), time.monotonic()))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while engine.stats["generated_tokens"] < 6:
        assert time.monotonic() < deadline, "generation did not start"
        time.sleep(0.005)
    os.kill(pids[0], signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 3
    for status, body, ended in results:
        # 500: it was running; 503: it reached the engine after the failure (a loaded machine is slow to start it)
        assert status in (500, 503) and "rank 1" in body["error"]["message"], body
        assert ended - killed < 30
    health = client.get("/health")
    assert health.status_code == 503 and "rank 1" in health.text
    engine.close()
    assert not any(alive(p) for p in pids)


def test_tp_the_model_cannot_split_is_refused_before_any_weight_loads(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("lmport.runner.load_model", no_load)
    with pytest.raises(ConfigError, match=r"tp=3 cannot split .* supports tp in \[1, 2, 4\]"):
        Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", tp=3))
    # The default model: 9 heads, 3 KV heads (its config comes from the GGUF's metadata).
    with pytest.raises(ConfigError, match=r"9 attention heads are not divisible by tp=2.* \[1, 3, 9\]"):
        Engine("smollm2", EngineConfig(device_type="cpu", tp=2))


def test_quantized_weights_at_tp_above_1_are_refused_before_any_weight_loads(monkeypatch):
    """Quantized weights are not sharded (docs/weight-quantization.md): a GGUF that would keep them is refused by
    the engine and by the plan, naming the two ways out; weight_format='dequantize' plans (and loads) float."""
    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("lmport.runner.load_model", no_load)
    refusal = r"tp=3: .*Q4_1.gguf holds quantized weights, which lmport does not shard .* use tp=1 .* " \
              r"weight_format='dequantize'"
    with pytest.raises(ConfigError, match=refusal):
        Engine("smollm2", EngineConfig(device_type="cpu", tp=3))
    with pytest.raises(ConfigError, match=refusal):
        plan.build_plan("smollm2", EngineConfig(device_type="cpu", tp=3), device_memory=8 << 30)
    report = plan.build_plan("smollm2", EngineConfig(device_type="cpu", tp=3, weight_format="dequantize"),
                             device_memory=8 << 30)
    assert set(report["weights"]["bytes_by_dtype"]) == {"float32"}


def test_plan_per_rank_figures_add_up_to_the_model():
    """Each rank's shard: the ranks' parameters add up to the model's, each KV head counted once a rank."""
    cfg = plan.read_model_config(tiny_model_dir("llama"))
    tp1 = plan.build_plan(tiny_model_dir("llama"), EngineConfig(device_type="cpu"), device_memory=1 << 30)
    tp2 = plan.build_plan(tiny_model_dir("llama"), EngineConfig(device_type="cpu", tp=2), device_memory=1 << 30)
    replicated = 4 * (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size   # the norms, on every rank
    assert sum(r["weight_bytes"] for r in tp2["ranks"]) == tp1["weights"]["bytes"] + replicated
    assert tp2["kv"]["bytes_per_block"] * 2 == tp1["kv"]["bytes_per_block"]
    assert "rank 1" in plan_format.format_plan(tp2)


# -- slow: the default model, the command line, two nodes ------------------------------------------------------

@pytest.mark.slow
def test_default_model_tp3_matches_tp1_on_8_prompts_of_32_tokens():
    prompts = [[1] + list(range(500 + 31 * i, 540 + 37 * i)) for i in range(8)]
    gen = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    # Float weights at both tp (quantized weights are not sharded).
    engines = [Engine(str(default_model_path()), EngineConfig(device_type="cpu", tp=tp, cache_max_entry_count=200,
                                                              weight_format="dequantize")) for tp in (1, 3)]
    try:
        tp1, tp3 = (greedy(e, prompts, gen) for e in engines)
        # Each rank's real allocation equals what `lmport plan --tp 3` prints for it.
        report = plan.build_plan("smollm2", EngineConfig(device_type="cpu", tp=3, cache_max_entry_count=200,
                                                         weight_format="dequantize"), device_memory=8 << 30)
        real = engines[1].executor.run_all("allocation")
        assert [(x["weight_bytes"], x["num_blocks"], x["cache_bytes"]) for x in report["ranks"]] == \
            [(x["weight_bytes"], x["num_blocks"], x["cache_bytes"]) for x in real]
    finally:
        for e in engines:
            e.close()
    assert tp3 == tp1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_match_tp1():
    model = tiny_model_dir("mistral")
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--device", "cpu", "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, "--cache-max-entry-count", "64"]
    worker = subprocess.Popen([sys.executable, "-m", "lmport.cli", "worker", model, "--node-rank", "1", *flags])
    try:
        engine = Engine(model, EngineConfig(device_type="cpu", tp=2, nnodes=2, dist_init_addr=addr,
                                            cache_max_entry_count=64))
        try:
            tp2 = greedy(engine)
        finally:
            engine.close()
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    assert tp2 == hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)


@pytest.mark.slow
def test_a_worker_that_cannot_reach_the_rendezvous_names_the_address():
    addr = f"127.0.0.1:{free_port()}"
    out = subprocess.run([sys.executable, "-m", "lmport.cli", "worker", tiny_model_dir("llama"), "--device", "cpu",
                          "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                          "--dist-timeout", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and f"cannot reach the tensor-parallel rendezvous at {addr}" in out.stderr


@pytest.mark.slow
def test_server_with_tp3_streamed_and_whole_chat_agree_and_sigterm_leaves_no_worker():
    import openai
    import psutil
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "lmport.cli", "serve", "smollm2", "--device", "cpu", "--tp", "3",
                               "--weight-format", "dequantize", "--port", str(port), "--cache-max-entry-count", "200"])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        children = psutil.Process(server.pid).children(recursive=True)   # the engine core and the tp workers
        workers = [c.pid for c in children]
        assert sum("_stdin_worker" in " ".join(c.cmdline()) for c in children) == 2
        messages = [{"role": "user", "content": "Name three colours."}]
        whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True) if chunk.choices)
        assert whole.choices[0].message.content == streamed and streamed
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert not any(alive(p) for p in workers)
