"""LoRA adapters through the server, with the official `openai` client: requests pick an adapter by
``model`` and get transformers + peft's tokens, /v1/models lists the adapters, and the run-time
load/unload routes (behind the API key, off unless enabled) keep every running request and refuse bad
input with an OpenAI-style error naming the field.
"""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pydantic
import pytest
import torch
from test_server import ServerThread

from lmport.engine import core_process as engine_core
from lmport.config import ConfigError, EngineConfig
from lmport.engine.engine import Engine
from lmport.server import adapters, shapes
from lmport.server.app import create_app
from support.model_helpers import hf_model, tiny_model_dir
from support.lora_adapters import adapter_dir, greedy, merged_model

API_KEY = "sk-lora-test"
TOKENS = 8


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 17)]


@pytest.fixture(scope="module")
def server():
    model_dir = tiny_model_dir("llama")
    engine = Engine(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=256,
                                            max_loras=2, max_lora_rank=8))
    engine_core.load_adapters(engine, {"r8": adapter_dir(model_dir, 8, seed=1)})   # as --lora does
    srv = ServerThread(create_app(engine, model_name="tiny", api_key=API_KEY, enable_lora_loading=True))
    yield srv
    srv.stop()


def client(srv, key=API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def complete(srv, model: str, prompt: list[int], max_tokens: int = TOKENS):
    return client(srv).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})


def post(srv, path: str, body, key=API_KEY) -> httpx.Response:
    return httpx.post(srv.url + path, content=json.dumps(body), timeout=60,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def test_requests_pick_their_adapter_by_model(server):
    model_dir = tiny_model_dir("llama")
    assert [m.id for m in client(server).models.list().data] == ["tiny", "r8"]
    assert client(server).models.retrieve("r8").model_extra["parent"] == "tiny"
    jobs = [(p, m) for p in prompts() for m in ("tiny", "r8")]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:   # in flight together
        replies = list(pool.map(lambda job: complete(server, job[1], job[0]), jobs))
    want = {"tiny": greedy(hf_model(model_dir), prompts(), TOKENS),
            "r8": greedy(merged_model(model_dir, adapter_dir(model_dir, 8, seed=1)), prompts(), TOKENS)}
    for (p, m), reply in zip(jobs, replies):
        assert reply.model == m
        assert reply.usage.completion_tokens == TOKENS
        ids = want[m][prompts().index(p)]
        assert reply.choices[0].text == hf_tokenizer(model_dir).decode(ids)


def hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def test_load_use_unload_under_load(server):
    model_dir = tiny_model_dir("llama")
    path = adapter_dir(model_dir, 8, seed=4)
    # vLLM's clients send load_inplace: false (what loading does anyway) is accepted, as is a field naming nothing
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "hot", "lora_path": path, "load_inplace": False,
                                               "x_client_note": "hi"})
    assert r.status_code == 200, r.text
    loaded = pydantic.TypeAdapter(shapes.LoadedAdapter).validate_python(r.json())   # the document's, no field more
    assert loaded["id"] == "hot" and loaded["parent"] == "tiny"
    assert "hot" in [m.id for m in client(server).models.list().data]
    requests = prompts() * 2
    # a thread each: every request is sent before the unload (a queued one would arrive after it, refused)
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        running = [pool.submit(complete, server, "hot", p, 48) for p in requests]
        first = complete(server, "hot", prompts()[0], 1)   # the adapter is serving by now
        assert first.model == "hot"
        r = post(server, "/v1/unload_lora_adapter", {"lora_name": "hot"})
        assert r.status_code == 200, r.text
        assert pydantic.TypeAdapter(shapes.UnloadedAdapter).validate_python(r.json())["deleted"] is True
        replies = [f.result() for f in running]
    assert all(x.choices[0].finish_reason == "length" and x.usage.completion_tokens == 48 for x in replies)
    want = greedy(merged_model(model_dir, path), prompts(), 48)
    text = [hf_tokenizer(model_dir).decode(ids) for ids in want] * 2
    assert [x.choices[0].text for x in replies] == text   # every one finished with its adapter
    with pytest.raises(openai.NotFoundError) as err:
        complete(server, "hot", prompts()[0])
    assert err.value.body["param"] == "model"
    assert "hot" not in [m.id for m in client(server).models.list().data]


def test_bad_input_names_the_field(server, tmp_path):
    model_dir = tiny_model_dir("llama")

    def refused(path, body, status, param):
        r = post(server, path, body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        return error["message"]

    with pytest.raises(openai.NotFoundError) as err:
        complete(server, "no-such-adapter", prompts()[0])
    assert err.value.body["param"] == "model" and "r8" in err.value.body["message"]
    big = adapter_dir(model_dir, 16, seed=2)
    # The reason is in the server's log; the client gets one message (no probing the server's disk).
    assert "could not be loaded" in refused("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": big}, 400,
                                            "lora_path")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    assert "could not be loaded" in refused("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(corrupt)},
                                            400, "lora_path")
    refused("/v1/load_lora_adapter", {"lora_name": "r8", "lora_path": big}, 409, "lora_name")
    refused("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": big}, 400, "lora_name")
    refused("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path")
    refused("/v1/load_lora_adapter", {"lora_name": "r8", "lora_path": big, "load_inplace": True}, 400, "load_inplace")
    refused("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": big}, key="wrong").status_code == 401


def test_echo_scores_the_prompt_with_the_adapter(server):
    """Prompt scoring is an engine request like any other, so it runs with the request's adapter."""
    scored = {model: client(server).completions.create(model=model, prompt="the cat sat on the mat", max_tokens=0,
                                                       echo=True, logprobs=0).choices[0].logprobs.token_logprobs
              for model in ("tiny", "r8")}
    assert scored["tiny"][0] is None and scored["r8"][0] is None
    assert len(scored["tiny"]) == len(scored["r8"]) > 2
    assert scored["tiny"][1:] != pytest.approx(scored["r8"][1:], abs=1e-3)


def test_loading_is_off_unless_enabled():
    engine = Engine(tiny_model_dir("llama"), EngineConfig(device_type="cpu", dtype="float32",
                                                          cache_max_entry_count=64, max_loras=1))
    srv = ServerThread(create_app(engine, model_name="tiny", api_key=API_KEY))
    try:
        r = post(srv, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"})
        assert r.status_code == 403 and "--enable-lora-loading" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_command_line_adapters():
    assert adapters.parse_loras(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    for bad in (["a"], ["=/x"], ["a=/x", "a=/y"]):
        with pytest.raises(ConfigError, match="--lora"):
            adapters.parse_loras(bad)
    assert adapters.max_loras_for(0, {"a": "/x", "b": "/y"}, False) == 2
    assert adapters.max_loras_for(0, {}, True) == 1 and adapters.max_loras_for(0, {}, False) == 0
    with pytest.raises(ConfigError, match="--max-loras 1"):
        adapters.max_loras_for(1, {"a": "/x", "b": "/y"}, False)
