"""What real client libraries send, as they send it: fields lmport does not implement, vLLM's structured_outputs,
the Responses API's input-token count, model listings and empty call arguments (docs/server.md).

Driven with the official `openai` and `anthropic` clients (or their exact bodies over HTTP where the client has no
argument for a field). The references are the clients' own behaviour (the anthropic SDK's tool runner sends its
conversation again without `thread` when told `thread_unsupported_request`), lmport's equivalent routes and fields
(guided_* for structured_outputs, /v1/responses' usage for the input-token count) and the constraints themselves
(a choice is one of the choices, JSON is valid against its schema).
"""
from __future__ import annotations

import datetime
import json
import logging
import re
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic import beta_tool

from support.cli_helpers import lmport_command
from support.model_helpers import tiny_tool_model_dir
from support.serve_process import ServeProcess
from test_server import tool_model_server

KEY = "sk-fields-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    server = tool_model_server(api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


def run_tool_runner(client: anthropic.Anthropic, model: str = "tiny") -> tuple[list, list[str]]:
    """The SDK's default tool runner (threads on) over a forced call: (its messages, the cities the tool got)."""
    cities: list[str] = []

    @beta_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    runner = client.beta.messages.tool_runner(model=model, max_tokens=200, messages=ASK, tools=[get_weather],
                                              tool_choice={"type": "tool", "name": "get_weather"}, max_iterations=2,
                                              extra_body={"temperature": 0})
    return list(runner), cities


# -- Anthropic's thread and the fields that change a request ------------------------------------------------------

def test_the_sdk_tool_runner_falls_back_from_threads_and_runs_the_tools(claude):
    # The runner's first turn asks for a thread ({"type": "create"}); refused with thread_unsupported_request, the
    # SDK sends every turn without one, each with the whole conversation. Before, lmport ignored the thread and the
    # second turn (a "continue" with only the tool result, no tools) was refused: "there are no tools".
    messages, cities = run_tool_runner(claude)
    assert len(messages) == 2 and len(cities) == 2
    assert all(m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"] for m in messages)
    assert set(cities) <= {"Paris", "Tokyo"}


@pytest.mark.parametrize("thread", [{"type": "create"}, {"type": "continue", "previous_message_id": "msg_1"}])
def test_a_thread_is_refused_with_the_code_the_sdk_reads(claude, thread):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.beta.messages.create(model="tiny", max_tokens=4, messages=ASK, extra_body={"thread": thread})
    assert caught.value.error_code == "thread_unsupported_request"   # what the SDK's threads branch on
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("thread: ")


REFUSED = [
    ("/v1/messages", "mcp_servers", [{"type": "url", "url": "https://example.com/sse", "name": "x"}]),
    ("/v1/messages", "container", "container_1"),
    ("/v1/messages", "context_management", {"edits": [{"type": "clear_tool_uses_20250919"}]}),
    ("/v1/messages", "compaction", {"type": "enabled"}),
    ("/v1/messages", "fallbacks", [{"model": "other"}]),
    ("/v1/messages/count_tokens", "thread", {"type": "create"}),
    ("/v1/messages/count_tokens", "mcp_servers", [{"type": "url", "url": "https://example.com/sse", "name": "x"}]),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "moderation", {"type": "auto"}),
    ("/v1/chat/completions", "min_tokens", 5),
    ("/v1/chat/completions", "stop_token_ids", [2]),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/completions", "suffix", " and so on."),
    ("/v1/completions", "skip_special_tokens", False),
    ("/v1/responses", "context_management", [{"type": "compaction"}]),
    ("/v1/responses", "moderation", {"type": "auto"}),
    ("/v1/responses/input_tokens", "personality", "friendly"),
]


def body_for(path: str, **fields) -> dict:
    if path.startswith("/v1/messages"):
        return {"model": "tiny", "messages": ASK, **({"max_tokens": 4} if path == "/v1/messages" else {}), **fields}
    if path == "/v1/chat/completions":
        return {"model": "tiny", "messages": ASK, "max_tokens": 4, **fields}
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": "Once", "max_tokens": 4, **fields}
    return {"model": "tiny", "input": "Hello", **({"max_output_tokens": 4} if path == "/v1/responses" else {}),
            **fields}


@pytest.mark.parametrize(("path", "name", "value"), REFUSED, ids=[f"{p}-{n}" for p, n, _ in REFUSED])
def test_a_field_that_changes_the_request_is_refused_by_name(server, path, name, value):
    r = post(server, path, body_for(path, **{name: value}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(f"{name}: not supported by this server")
    if not path.startswith("/v1/messages"):
        assert (error["param"], error["code"]) == (name, "unsupported_parameter")


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/messages", {"service_tier": "auto", "inference_geo": "us", "speed": "standard", "mcp_servers": None}),
    ("/v1/chat/completions", {"modalities": ["text"], "min_tokens": 0, "service_tier": "auto",
                              "prompt_cache_key": "k", "verbosity": "low"}),
    ("/v1/completions", {"suffix": "", "skip_special_tokens": True}),
    ("/v1/responses", {"service_tier": "auto", "safety_identifier": "u1", "max_tool_calls": 3}),
], ids=["messages", "chat", "completions", "responses"])
def test_fields_that_ask_for_what_lmport_does_are_accepted(server, path, fields):
    r = post(server, path, body_for(path, **fields))
    assert r.status_code == 200, r.text


def test_an_unknown_field_is_accepted_and_logged_once_per_route(server, caplog):
    caplog.set_level(logging.WARNING, logger="lmport.server.protocol")
    for _ in range(2):
        for path in ("/v1/chat/completions", "/v1/messages"):
            assert post(server, path, body_for(path, lmport_test_field=1)).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "lmport_test_field" in r.getMessage()]
    assert len(lines) == 2 and {line.split(":")[0] for line in lines} == {"/v1/chat/completions", "/v1/messages"}


# -- vLLM's structured_outputs ------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
STRUCTURED = [  # (structured_outputs, the guided_* field it stands for, a check of the text)
    ({"choice": ["red", "green", "blue"]}, {"guided_choice": ["red", "green", "blue"]},
     lambda text: text in ("red", "green", "blue")),
    ({"regex": "[0-9]{3}-[a-z]{2}"}, {"guided_regex": "[0-9]{3}-[a-z]{2}"},
     lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text) is not None),
    ({"json": SCHEMA}, {"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"grammar": 'root ::= "a" | "bb"'}, {"guided_grammar": 'root ::= "a" | "bb"'}, lambda text: text in ("a", "bb")),
    # A random model's object need not end within max_tokens: it starts as one.
    ({"json_object": True}, {"response_format": {"type": "json_object"}}, lambda text: text.lstrip().startswith("{")),
]


@pytest.mark.parametrize(("structured", "guided", "check"), STRUCTURED, ids=["choice", "regex", "json", "grammar",
                                                                             "json_object"])
def test_structured_outputs_constrain_as_the_guided_field_does(oai, structured, guided, check):
    def reply(extra: dict) -> str:
        c = oai.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0, extra_body=extra)
        return c.choices[0].message.content or ""

    text = reply({"structured_outputs": structured})
    assert check(text), text
    assert text == reply(guided)   # the same constraint, greedy: the same tokens


def test_structured_outputs_on_completions(oai):
    c = oai.completions.create(model="tiny", prompt="Colour:", max_tokens=20, temperature=0,
                               extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert c.choices[0].text in ("red", "green")


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a"], "made_up": 1}}, "structured_outputs.made_up"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
], ids=["with-guided", "with-response_format", "two", "none", "structural_tag", "whitespace", "unknown-key",
        "bad-regex", "bad-json"])
def test_structured_outputs_problems_name_the_field(server, fields, param):
    r = post(server, "/v1/chat/completions", body_for("/v1/chat/completions", **fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- the Responses API's input-token count ------------------------------------------------------------------------

FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": WEATHER["input_schema"]}


@pytest.mark.parametrize("fields", [
    {"input": "Hello there"},
    {"input": ASK, "instructions": "Be brief.", "tools": [FUNCTION]},
    {"input": [*ASK, {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}], "tools": [FUNCTION]},
], ids=["text", "instructions-and-tools", "call-history"])
def test_input_tokens_count_what_a_response_reads(oai, fields):
    count = oai.responses.input_tokens.count(model="tiny", **fields)
    assert count.object == "response.input_tokens"
    response = oai.responses.create(model="tiny", max_output_tokens=1, **fields)
    assert response.usage is not None and count.input_tokens == response.usage.input_tokens


def test_input_tokens_refuse_stored_state(server):
    r = post(server, "/v1/responses/input_tokens", {"model": "tiny", "input": "Hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


# -- /v1/models for both clients ----------------------------------------------------------------------------------

def test_models_read_by_both_clients(claude, oai):
    openai_models = oai.models.list().data
    assert [m.id for m in openai_models] == ["tiny"] and openai_models[0].owned_by == "lmport"
    page = claude.models.list()
    assert [m.id for m in page.data] == ["tiny"] and not page.has_more
    assert (page.first_id, page.last_id) == ("tiny", "tiny")
    model = claude.models.retrieve("tiny")
    assert model.type == "model" and model.display_name == "tiny"
    assert model.created_at == datetime.datetime.fromtimestamp(openai_models[0].created, datetime.UTC)


# -- "arguments": "" in an assistant's earlier call ---------------------------------------------------------------

def history(arguments: str) -> list[dict]:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]


def test_empty_call_arguments_are_an_empty_object(oai):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                 "properties": {}}}}]
    empty, braces = (oai.chat.completions.create(model="tiny", messages=history(a), tools=tools, max_tokens=1)
                     for a in ("", "{}"))
    assert empty.usage is not None and braces.usage is not None
    assert empty.usage.prompt_tokens == braces.usage.prompt_tokens


def test_empty_call_arguments_in_responses_input(oai):
    def items(arguments: str) -> list:
        return [*ASK, {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": arguments},
                {"type": "function_call_output", "call_id": "c1", "output": "noon"}]
    empty, braces = (oai.responses.input_tokens.count(model="tiny", input=items(a)) for a in ("", "{}"))
    assert empty.input_tokens == braces.input_tokens


# -- `lmport serve` in a process: the tool runner, and the access log on its stderr -------------------------------

@pytest.mark.slow
def test_the_tool_runner_completes_against_lmport_serve(tmp_path):
    log = tmp_path / "serve.log"
    serve = ServeProcess(lmport_command(), [tiny_tool_model_dir(), "--host", "127.0.0.1", "--session-len", "1024",
                                            "--cache-max-entry-count", "64", "--access-log-format", "json"], log)
    try:
        serve.ready()
        client = anthropic.Anthropic(base_url=serve.url, api_key="none", max_retries=0)
        messages, cities = run_tool_runner(client, model=tiny_tool_model_dir())   # the model as `serve` was given it
        assert len(messages) == 2 and len(cities) == 2
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        turns = [(line["route"], line["status"]) for line in lines if line["route"] == "/v1/messages"]
        # The first turn's thread refused, then both turns answered without one.
        assert turns == [("/v1/messages", 400), ("/v1/messages", 200), ("/v1/messages", 200)]
        assert "What is the weather" not in log.read_text()   # never a prompt's text
    finally:
        serve.stop()
