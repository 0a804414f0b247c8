"""Tensor parallelism on the cpu backend over gloo: the same greedy tokens as tp=1 and transformers.

Each test builds (and closes) its own engines, tiny random-weight models at tp 2 or 4: a process runs one
tensor-parallel engine at a time, and a test may break its engine. Two nodes and a server stopped by SIGTERM
run as subprocesses on loopback; the default model at tp=3 is marked slow.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from support.cli_helpers import lmport_command
from support.model_helpers import default_model_path, hf_greedy, tiny_model_dir
from support.serve_process import ServeProcess

from lmport.memory import plan, plan_format
from lmport.config import ConfigError, EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app

PROMPTS = [[1] + list(range(100 + 7 * i, 120 + 13 * i)) for i in range(4)]
GREEDY = GenerationConfig(max_new_tokens=12, ignore_eos=True)


def greedy(engine: Engine, prompts=PROMPTS, gen=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, gen) for p in prompts]
    done = {}
    deadline = time.monotonic() + 600   # a hang guard (an engine that stops scheduling loops here)
    while len(done) < len(ids):
        assert time.monotonic() < deadline, (f"the engine makes no progress: {engine.usage()}, {len(done)} of "
                                             f"{len(ids)} done, {len(engine.scheduler.waiting)} waiting")
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


@pytest.mark.slow   # the default run splits KV heads at tp=2 (test_tp2_tokens_and_perplexity_match_tp1...)
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


# What the workload checks is in the prompts' blocks (cached, evicted to the host, read back): a few tokens each.
PREFIX_GREEDY = GenerationConfig(max_new_tokens=4, ignore_eos=True)


def run_prefix_workload(engine: Engine) -> list[list[int]]:
    """One prompt at a time, then one that evicts the cached blocks to the host, then the first again."""
    prompts = shared_prefix_prompts()
    evicting = list(range(3000, 3150))
    return [greedy(engine, [p], PREFIX_GREEDY)[0] for p in prompts + prompts[:1] + [evicting] + prompts[:1]]


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


TINY = dict(device_type="cpu", cache_max_entry_count=64)


def get_ppl(engine: Engine) -> list[float]:
    from lmport.entrypoints.api import Pipeline
    pipe = Pipeline.__new__(Pipeline)          # a Pipeline over this engine
    pipe.engine, pipe.tokenizer = engine, engine.tokenizer
    return pipe.get_ppl([PROMPTS[0]], logits_budget_bytes=8 * 49152 * 4)   # chunks of 8 positions


def test_tp2_tokens_and_perplexity_match_tp1_and_transformers():
    """Greedy tokens, and get_ppl through the ranks."""
    results = []
    for tp in (1, 2):
        engine = Engine(tiny_model_dir("llama"), EngineConfig(tp=tp, **TINY))
        try:
            results.append((greedy(engine), get_ppl(engine)))
        finally:
            engine.close()
    (tp1, ppl1), (tp2, ppl2) = results
    assert tp2 == tp1 == hf_greedy(tiny_model_dir("llama"), PROMPTS, GREEDY.max_new_tokens)
    assert ppl2 == pytest.approx(ppl1, rel=1e-5)


def test_a_killed_worker_ends_every_request_with_an_error_naming_its_rank():
    engine = Engine(tiny_model_dir("llama"), EngineConfig(tp=2, **TINY))
    try:
        pids = list(engine.executor.worker_pids.values())
        client = TestClient(create_app(engine))
        assert client.get("/health").status_code == 200
        results = []

        def ask(i):
            r = client.post("/v1/completions", json={"model": engine.model_name, "prompt": f"count {i}",
                                                     "max_tokens": 200, "ignore_eos": True})
            results.append((r.status_code, r.json()))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120   # a hang guard
        while engine.stats["generated_tokens"] < 6:
            assert time.monotonic() < deadline, "generation did not start"
            time.sleep(0.005)
        os.kill(pids[0], signal.SIGKILL)
        for t in threads:
            t.join(timeout=120)   # the collective fails at once; this only guards against a hang
        assert len(results) == 3
        for status, body in results:
            # 500: it was running; 503: it reached the engine after the failure (a loaded machine is slow to start it)
            assert status in (500, 503) and "rank 1" in body["error"]["message"], body
        health = client.get("/health")
        assert health.status_code == 503 and "rank 1" in health.text
    finally:
        engine.close()
    assert not any(alive(p) for p in pids)


def test_tp_the_model_cannot_split_is_refused_before_any_weight_loads(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("lmport.worker.runner.load_model", no_load)
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

    monkeypatch.setattr("lmport.worker.runner.load_model", no_load)
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


# -- the default model at tp=3 (slow); two nodes and the command line, in subprocesses -----------------------------

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


# What node 0's executor logs when its rendezvous port was 0 (chosen by the OS).
RENDEZVOUS = re.compile(r"tensor-parallel rendezvous listens at ([\w.\-]+:\d+)")


class _Rendezvous(logging.Handler):
    """The address node 0's executor logs, for the test to start node 1 with (None: node 0 failed first)."""

    def __init__(self):
        super().__init__()
        self.found: queue.Queue = queue.Queue()

    def emit(self, record):
        if match := RENDEZVOUS.search(record.getMessage()):
            self.found.put(match.group(1))


def test_two_nodes_on_loopback_match_tp1():
    """Node 0 (rank 0, an engine in this process) binds its rendezvous at port 0 and logs the address it got;
    node 1 (`lmport worker`, rank 1) is started with that address and ends when node 0's engine does."""
    model = tiny_model_dir("mistral")
    rendezvous, started, node1 = _Rendezvous(), [], None

    def start_node0():   # returns once every rank has joined
        try:
            started.append(Engine(model, EngineConfig(tp=2, nnodes=2, dist_init_addr="127.0.0.1:0", **TINY)))
        except BaseException as exc:
            started.append(exc)
            rendezvous.found.put(None)

    logging.getLogger("lmport.executor.local").addHandler(rendezvous)
    node0 = threading.Thread(target=start_node0)
    node0.start()
    try:
        addr = rendezvous.found.get(timeout=300)   # a hang guard
        assert addr is not None, started
        node1 = subprocess.Popen([*lmport_command(), "worker", model, "--device", "cpu", "--tp", "2", "--nnodes", "2",
                                  "--node-rank", "1", "--dist-init-addr", addr, "--cache-max-entry-count", "64"])
        node0.join(300)
        (engine,) = started
        assert isinstance(engine, Engine), engine
        try:
            tp2 = greedy(engine)
        finally:
            engine.close()
        assert node1.wait(timeout=120) == 0
    finally:
        logging.getLogger("lmport.executor.local").removeHandler(rendezvous)
        if node1 is not None and node1.poll() is None:
            node1.kill()
            node1.wait()
    assert tp2 == hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)


def test_sigterm_to_a_tp2_server_leaves_no_process_behind(tmp_path):
    import psutil
    model = tiny_model_dir("llama")
    server = ServeProcess(lmport_command(), [model, "--device", "cpu", "--tp", "2", "--cache-max-entry-count", "64"],
                          tmp_path / "serve.log")
    try:
        server.ready()
        children = psutil.Process(server.proc.pid).children(recursive=True)   # the engine core and the tp worker
        assert sum("_stdin_worker" in " ".join(c.cmdline()) for c in children) == 1
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": model, "prompt": "a", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=120) == 0, server.log.read_text()
    finally:
        server.stop()
    assert not any(alive(c.pid) for c in children)


@pytest.mark.slow
def test_a_worker_that_cannot_reach_the_rendezvous_names_the_address():
    with socket.socket() as unreachable:   # bound, never listening: connections are refused, and nobody else
        unreachable.bind(("127.0.0.1", 0))   # can take the port while the worker tries it
        addr = f"127.0.0.1:{unreachable.getsockname()[1]}"
        out = subprocess.run([sys.executable, "-m", "lmport", "worker", tiny_model_dir("llama"), "--device",
                              "cpu", "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                              "--dist-timeout", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and f"cannot reach the tensor-parallel rendezvous at {addr}" in out.stderr


@pytest.mark.slow
def test_server_with_tp3_streamed_and_whole_chat_agree_and_sigterm_leaves_no_worker(tmp_path):
    import openai
    import psutil
    server = ServeProcess([sys.executable, "-m", "lmport"], ["smollm2", "--device", "cpu", "--tp", "3",
                                                                  "--weight-format", "dequantize",
                                                                  "--cache-max-entry-count", "200"],
                          tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=server.ready().url + "/v1", api_key="none", max_retries=0)
        children = psutil.Process(server.proc.pid).children(recursive=True)   # the engine core and the tp workers
        workers = [c.pid for c in children]
        assert sum("_stdin_worker" in " ".join(c.cmdline()) for c in children) == 2
        messages = [{"role": "user", "content": "Name three colours."}]
        whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True) if chunk.choices)
        assert whole.choices[0].message.content == streamed and streamed
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log.read_text()
    finally:
        server.stop()
    assert not any(alive(p) for p in workers)
