"""OpenAI compatibility found by outside suites (issue 35): nulls, model retrieval, the OpenAPI document,
logit_bias, error codes, the stream's shape and usage statistics.

One server over the tiny random-weight Qwen2 model (its Qwen 2.5-style template has special tokens)
runs in a thread of this process for the whole module.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from support.model_helpers import tiny_tool_model_dir
from test_server import ServerThread

SESSION_LEN = 512


@pytest.fixture(scope="module")
def server():
    engine = Engine(tiny_tool_model_dir(), EngineConfig(cache_max_entry_count=128, session_len=SESSION_LEN))
    server = ServerThread(create_app(engine, model_name="tiny"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def events(server, path: str, body: dict) -> list[dict]:
    """The data of every server-sent event of a stream, [DONE] last (as the string)."""
    out = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    assert out[-1] == "[DONE]"
    return out


NULLABLE = ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream", "seed", "stop",
            "logit_bias", "stream_options", "max_tokens", "top_k", "min_p", "repetition_penalty", "ignore_eos")


def test_null_means_the_default(server, client):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for name in (*NULLABLE, "logprobs", "parallel_tool_calls", "max_completion_tokens", "top_logprobs"):
        limit = "max_completion_tokens" if name == "max_tokens" else "max_tokens"
        r = post(server, "/v1/chat/completions", {**chat, limit: 2, name: None})
        assert r.status_code == 200, (name, r.text)
    for name in (*NULLABLE, "logprobs", "echo", "best_of", "suffix", "user"):
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, name: None})
        assert r.status_code == 200, (name, r.text)
    # The SDK sends null for every argument passed as None.
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=None, top_p=None, n=None, logprobs=None, stream=None,
                                       presence_penalty=None, frequency_penalty=None,
                                       extra_body={"ignore_eos": True})   # a random model may say EOS
    assert r.choices[0].finish_reason == "length"


def test_models_retrieve(server, client):
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    r = httpx.get(server.url + "/v1/models/other", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt=list(range(5, 5 + SESSION_LEN)), max_tokens=2)
    assert exc.value.code == "context_length_exceeded"
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": " hello" * SESSION_LEN}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "messages"


def test_405_has_allow_and_unknown_routes_a_named_code(server):
    r = httpx.get(server.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def _conforms(doc: dict, name: str, instance) -> None:
    jsonschema.validate(instance, {**doc, "$ref": f"#/components/schemas/{name}"})


def test_openapi_describes_every_route_and_the_replies_conform(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    paths = doc["paths"]
    assert set(paths) >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}",
                          "/health", "/metrics"}
    for path, request in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        op = paths[path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request)
        assert {"200", "400", "404", "413", "503"} <= set(op["responses"])
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for path in ("/v1/embeddings", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):   # no body: a 415
        op = paths[path]["post"]
        assert op["requestBody"]["required"] and {"200", "400", "415"} <= set(op["responses"]), path
    for request in ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest", "MessagesRequest"):
        assert doc["components"]["schemas"][request]["properties"]["model"]["enum"] == ["tiny"], request
    chat = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json()
    _conforms(doc, "ChatCompletion", chat)
    completion = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, "logprobs": 2,
                                                  "echo": True}).json()
    _conforms(doc, "Completion", completion)
    _conforms(doc, "ModelList", httpx.get(server.url + "/v1/models", timeout=10).json())
    _conforms(doc, "ErrorResponse", post(server, "/v1/completions", {"model": "tiny", "prompt": []}).json())
    with pytest.raises(jsonschema.ValidationError):
        _conforms(doc, "Completion", {**completion, "choices": [{**completion["choices"][0], "text": 5}]})


def test_logit_bias_steers_decoding_within_openai_bounds(server):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_tool_model_dir())

    def text(bias: dict, **kw) -> str:
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 4, "ignore_eos": True,
                                             "logit_bias": bias, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text({"1000": 90, "2000": 100}, temperature=0) == tok.decode([2000] * 4)
    assert text({"1000": 90, "2000": -100}, temperature=0) == tok.decode([1000] * 4)   # 2000 is banned
    assert text({"1000": 100}, temperature=1.5, seed=3) == tok.decode([1000] * 4)
    for body, param in (({"1000": 101}, "logit_bias.1000"), ({"x": 1}, "logit_bias.x"),
                        ({str(i): 1 for i in range(301)}, "logit_bias"), ({"49152000": 1}, "logit_bias"),
                        ({"5": "1"}, "logit_bias.5")):
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": "the", "logit_bias": body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert "logit_bias" in r.json()["error"]["message"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}}, "required": ["city"]}}}


def test_chat_stream_shape(server):
    """The role alone first (content null), no empty content deltas, a last chunk with an empty delta and the
    finish reason, system_fingerprint on every chunk (llama.cpp's server tests check each of these)."""
    cases = [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "n": 2},
             {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 40, "tools": [TOOL],
              "tool_choice": "required", "logprobs": True, "top_logprobs": 1}]
    for body in cases:
        chunks = events(server, "/v1/chat/completions", {"model": "tiny", **body})[:-1]
        for c in range(body.get("n", 1)):
            mine = [ch for ch in chunks if ch["choices"][0]["index"] == c]
            assert mine[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
            assert mine[-1]["choices"][0]["delta"] == {} and mine[-1]["choices"][0]["finish_reason"]
            for ch in mine[1:-1]:
                delta = ch["choices"][0]["delta"]
                assert "role" not in delta and ch["choices"][0]["finish_reason"] is None
                assert delta.get("content") or delta.get("tool_calls"), delta
        assert all(ch["system_fingerprint"] for ch in chunks)
        if body.get("tools"):
            assert any(ch["choices"][0]["delta"].get("tool_calls") for ch in chunks)
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2}).json()
    assert r["system_fingerprint"] and r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_stream_options_continuous_usage_stats(server):
    """vLLM's extension (guidellm sends it): every chunk carries the usage so far."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        chunks = events(server, path, {"model": "tiny", **body, "max_tokens": 5, "ignore_eos": True,
                                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        chunks = chunks[:-1]
        assert all(ch.get("usage") for ch in chunks), chunks
        completion = [ch["usage"]["completion_tokens"] for ch in chunks]
        assert completion == sorted(completion) and completion[-1] == 5
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5 + chunks[-1]["usage"][
            "prompt_tokens"]
        plain = events(server, path, {"model": "tiny", **body, "max_tokens": 3,
                                      "stream_options": {"include_usage": True}})[:-1]
        assert all(ch.get("usage") is None for ch in plain[:-1]) and plain[-1]["usage"]


def test_openapi_states_stream_events_and_the_rules_schemas_can_state(server):
    import json
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path, chunk, body in (
            ("/v1/chat/completions", "ChatCompletionChunk", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", "CompletionChunk", {"prompt": "hi"})):
        event = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        data = event["properties"]["data"]["anyOf"][1]
        assert data["contentSchema"]["anyOf"][0]["$ref"].endswith(chunk)
        with httpx.stream("POST", server.url + path, timeout=60, json={
                "model": "tiny", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                **body}) as r:
            lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        for line in lines:
            jsonschema.validate({"data": line, "event": "message"}, {**doc, **event})
        for line in lines[:-1]:
            _conforms(doc, chunk, json.loads(line))
    request = {"model": "tiny", "messages": [{"role": "tool", "content": "4"}]}
    with pytest.raises(jsonschema.ValidationError):   # a tool message names its call
        _conforms(doc, "ChatCompletionRequest", request)
    _conforms(doc, "ChatCompletionRequest", {**request, "messages": [{**request["messages"][0], "tool_call_id": "c"}]})
    with pytest.raises(jsonschema.ValidationError):   # only assistant messages carry tool calls
        _conforms(doc, "ChatCompletionRequest", {"model": "tiny", "messages": [{"role": "user", "content": "x",
                                                 "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]})
    for field, value in (("guided_grammar", ""), ("functions", [{"name": "f"}]), ("best_of", 2)):
        with pytest.raises(jsonschema.ValidationError):
            _conforms(doc, "CompletionRequest", {"model": "tiny", "prompt": "a", field: value})


@pytest.mark.parametrize("fields,pattern", [
    ({"guided_regex": "a{3}"}, "aaa"),
    ({"grammar": 'root ::= "b"{4}'}, "bbbb"),                          # llama.cpp's name for guided_grammar
    ({"json_schema": {"const": "42"}}, '"42"'),                        # llama.cpp's name for guided_json
    ({"response_format": {"type": "json_object", "schema": {"const": "42"}}}, '"42"'),   # llama.cpp's extension
])
def test_structured_fields_constrain_chat_as_they_do_completions(server, fields, pattern):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = post(server, path, {"model": "tiny", "max_tokens": 8, "temperature": 0, **body, **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"] if "message" in choice else choice["text"]) == pattern


def test_two_structured_fields_are_refused_naming_the_second(server):
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "response_format": {"type": "json_object", "schema": 123}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


PREFILL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


def test_continue_final_message_continues_the_assistant_turn_as_transformers_renders_it(server):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_tool_model_dir())
    reference = tokenizer.apply_chat_template(PREFILL, continue_final_message=True, add_generation_prompt=False,
                                              tokenize=True, return_dict=False)
    assert tokenizer.decode(reference).endswith("The colour is")   # the turn is left open
    chat = post(server, "/v1/chat/completions", {"model": "tiny", "messages": PREFILL, "max_tokens": 6,
                                                  "temperature": 0, "continue_final_message": True,
                                                  "add_generation_prompt": False})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(reference)
    same = post(server, "/v1/completions", {"model": "tiny", "prompt": reference, "max_tokens": 6, "temperature": 0})
    assert chat.json()["choices"][0]["message"]["content"] == same.json()["choices"][0]["text"]

    # Without a generation prompt the template's own rendering of the whole conversation, closed turn included.
    closed = tokenizer.apply_chat_template(PREFILL, add_generation_prompt=False, tokenize=True, return_dict=False)
    plain = post(server, "/v1/chat/completions", {"model": "tiny", "messages": PREFILL, "max_tokens": 1,
                                                   "add_generation_prompt": False})
    assert plain.status_code == 200 and plain.json()["usage"]["prompt_tokens"] == len(closed) != len(reference)


def test_continue_final_message_with_a_generation_prompt_or_no_assistant_message_is_a_400(server):
    both = post(server, "/v1/chat/completions", {"model": "tiny", "messages": PREFILL, "continue_final_message": True})
    error = both.json()["error"]
    assert both.status_code == 400 and error["param"] == "continue_final_message", both.text
    assert "continue_final_message" in error["message"] and "add_generation_prompt" in error["message"]
    user_last = post(server, "/v1/chat/completions", {"model": "tiny", "messages": PREFILL[:1],
                                                      "continue_final_message": True, "add_generation_prompt": False})
    assert user_last.status_code == 400 and "assistant" in user_last.json()["error"]["message"], user_last.text
