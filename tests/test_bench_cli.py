"""`lmport bench`: latency and throughput on a tiny model with a tiny budget, each writing its JSON into --out;
serve against an in-process server, its client timing the same chunks and tokens the official openai client
reads from the same stream."""
from __future__ import annotations

import asyncio
import json
import statistics

import httpx
import openai
import pytest

from support.model_helpers import tiny_model_dir
from test_server import ServerThread

from lmport.bench import client
from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.entrypoints.cli import main
from lmport.server.app import create_app

TINY = ["--device", "cpu", "--cache-max-entry-count", "64"]


def written(directory, name: str) -> dict:
    files = list(directory.glob(f"{name}-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def assert_summarizes(summary: dict, rounds: list[dict]) -> None:
    """Each measure's median (min-max) over the rounds; None where a round has none (an inter-token latency of
    requests whose tokens all came in one chunk)."""
    for key, s in summary.items():
        values = [r[key] for r in rounds]
        if any(v is None for v in values):
            assert s is None, key
        else:
            assert s == {"median": statistics.median(values), "min": min(values), "max": max(values)}, key


def test_latency_writes_its_rounds_into_out(tmp_path):
    model = tiny_model_dir("llama")
    assert main(["bench", "latency", model, "--prompt-tokens", "12", "--decode-tokens", "3", "--rounds", "2",
                 "--out", str(tmp_path), *TINY]) == 0
    result = written(tmp_path, "latency")
    assert result["benchmark"] == "latency" and result["model"] == model and result["backend"] == "cpu"
    assert len(result["rounds"]) == 2 and set(result["summary"]) == {"prefill", "decode@0", "decode@12"}
    assert_summarizes(result["summary"], result["rounds"])
    assert all(v > 0 for r in result["rounds"] for v in r.values())
    assert result["weight_bytes"] > 0 and result["machine"]["memory_bandwidth"]["best_gbs"] > 0


def test_throughput_writes_its_rounds_into_out(tmp_path):
    model = tiny_model_dir("llama")
    assert main(["bench", "throughput", model, "--requests", "6", "--max-prompt-tokens", "24", "--output-lengths",
                 "2", "5", "--rounds", "2", "--out", str(tmp_path), *TINY]) == 0
    result = written(tmp_path, "throughput")
    assert result["workload"]["output_tokens"] == 3 * 2 + 3 * 5   # every request its exact length
    assert [r["requests"] for r in result["rounds"]] == [6, 6]
    assert_summarizes(result["summary"], result["rounds"])


def test_without_out_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "latency", tiny_model_dir("llama"), "--prompt-tokens", "4", "--decode-tokens", "1",
                 "--rounds", "1", *TINY]) == 0
    assert list(tmp_path.iterdir()) == []
    assert "| decode@4 |" in capsys.readouterr().out


def test_a_bad_budget_is_refused_before_the_model_loads():
    with pytest.raises(SystemExit, match="--requests and --rounds must be at least 1"):
        main(["bench", "throughput", "nowhere", "--rounds", "0"])


@pytest.fixture(scope="module")
def server():
    engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", cache_max_entry_count=64))
    server = ServerThread(create_app(engine, model_name="tiny"))
    yield server
    server.stop()


def test_serve_loads_any_base_url_and_writes_into_out(server, tmp_path):
    assert main(["bench", "serve", "--url", server.url + "/v1", "--concurrency", "1", "3", "--max-tokens", "5",
                 "--rounds", "2", "--out", str(tmp_path)]) == 0
    result = written(tmp_path, "serve")
    assert result["model"] == "tiny" and result["url"] == server.url   # the first model /v1/models lists
    assert result["concurrency"] == [1, 3] and len(result["rounds"]) == 2
    for rnd in result["rounds"]:
        for level, load in rnd.items():
            assert load["succeeded"] == load["requests"] == int(level) and load["errors"] == []
            assert load["output_tokens"] == 5 * int(level)
    for level, s in result["summary"].items():
        assert_summarizes({k: s[k] for k in ("ttft_s", "itl_s", "tpot_s", "output_tokens_per_s")},
                          [rnd[level] for rnd in result["rounds"]])


def test_the_client_reads_the_chunks_and_usage_the_openai_client_reads(server):
    """One stream of the server, recorded, replayed to the official openai client and to lmport bench's client:
    the same chunks of content and the same usage (the chunking of two live requests may differ)."""
    body = client.chat_body("tiny", 3, 16)
    recorded = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert recorded.status_code == 200

    def replay(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=recorded.content)
    official = openai.OpenAI(base_url="http://replay/v1", api_key="none",
                             http_client=httpx.Client(transport=httpx.MockTransport(replay)))
    chunks = list(official.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=16,
                                                   stream=True, stream_options={"include_usage": True}))
    contents = [c for c in chunks if c.choices and c.choices[0].delta.content]
    usage = next(c.usage for c in chunks if c.usage)

    async def timed():
        async with httpx.AsyncClient(transport=httpx.MockTransport(replay)) as http:
            return await client.stream_chat(http, "http://replay", body, {})
    ours = asyncio.run(timed())
    assert ours["ok"] and ours["error"] is None
    assert ours["completion_tokens"] == usage.completion_tokens == 16
    # A gap between each two chunks of content. How many chunks there are is the server's timing (a stream sends the
    # tokens made since its last chunk in one) and the tiny model's tokens (one ending inside a UTF-8 character adds
    # no content), so the count is read, not assumed.
    assert contents and len(ours["itl"]) == len(contents) - 1
    assert 0 < ours["ttft"] <= ours["latency"]


def test_a_base_url_is_taken_with_or_without_v1():
    assert client.base_url("http://127.0.0.1:8000/v1/") == client.base_url("http://127.0.0.1:8000") \
        == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="give the server's base URL"):
        client.base_url("127.0.0.1:8000")


def test_a_url_with_no_server_is_named(tmp_path):
    import socket
    with socket.socket() as sock:   # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(SystemExit, match=f"no OpenAI-compatible server at {url} within 0.5 s"):
        main(["bench", "serve", "--url", url, "--ready-timeout", "0.5", "--out", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []
