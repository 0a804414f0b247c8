"""The access log (lmport.server.access_log): one line per request with its method, route, status, latency, tokens
in and out and request id, and never a prompt's text.

The references are each answer's own usage as the official `openai` and `anthropic` clients read it (the tokens a
line reports are the ones the client was billed), and the request id the client got in the `x-request-id` header.
"""
from __future__ import annotations

import json
import logging
import re
import time

import anthropic
import httpx
import openai
import pytest

from lmport.entrypoints.cli import build_parser
from lmport.server import access_log
from test_server import ServerThread, tool_model_server

KEY = "sk-access-log-test"
PROMPT = "Tell me about the secret garden"
PLAIN = re.compile(r'^(?P<client>\S+) (?P<method>[A-Z]+) (?P<route>"[^"]*") (?P<status>\d+|-) (?P<latency>[0-9.]+)s '
                   r'in=(?P<tokens_in>\d+|-) out=(?P<tokens_out>\d+|-) id=(?P<request_id>\S+)$')


def start(fmt: str | None) -> ServerThread:
    return tool_model_server(api_key=KEY, access_log_format=fmt)


@pytest.fixture(scope="module")
def server():
    server = start("plain")
    yield server
    server.stop()


@pytest.fixture
def lines(caplog):
    """The access lines logged so far, each as a dict of its fields (parsed from the plain format)."""
    caplog.set_level(logging.INFO, logger="lmport.access")

    def parsed() -> list[dict]:
        out = []
        for record in caplog.records:
            if record.name == "lmport.access":
                match = PLAIN.match(record.getMessage())
                assert match, record.getMessage()
                fields = match.groupdict()
                fields["route"] = json.loads(fields["route"])
                out.append(fields)
        return out
    return parsed


def line_for(lines, request_id: str) -> dict:
    """The line of ``request_id``; it is written once the answer has been sent, so it may come just after it."""
    deadline = time.monotonic() + 30
    while not (found := [line for line in lines() if line["request_id"] == request_id]):
        assert time.monotonic() < deadline, f"no access line for {request_id}"
        time.sleep(0.01)
    assert len(found) == 1
    return found[0]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_a_chat_line_has_the_usage_the_client_got(oai, lines, caplog):
    raw = oai.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=5, n=2, temperature=1)
    completion = raw.parse()
    line = line_for(lines, raw.headers["x-request-id"])
    assert completion.usage is not None
    assert (line["method"], line["route"], line["status"]) == ("POST", "/v1/chat/completions", "200")
    assert (int(line["tokens_in"]), int(line["tokens_out"])) == (completion.usage.prompt_tokens,
                                                                 completion.usage.completion_tokens)
    assert line["client"].startswith("127.0.0.1:") and float(line["latency"]) > 0
    assert not any("secret garden" in r.getMessage() for r in caplog.records)


def test_a_streamed_chat_line_counts_what_was_streamed(oai, lines):
    with oai.chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, n=2, stream=True,
            stream_options={"include_usage": True}) as raw:
        usage = [chunk.usage for chunk in raw.parse() if chunk.usage is not None][-1]
        request_id = raw.headers["x-request-id"]
    line = line_for(lines, request_id)
    assert (int(line["tokens_in"]), int(line["tokens_out"])) == (usage.prompt_tokens, usage.completion_tokens)


def test_a_completions_line_counts_every_prompt(oai, lines):
    raw = oai.completions.with_raw_response.create(model="tiny", prompt=["One", "Two three"], max_tokens=3)
    usage = raw.parse().usage
    line = line_for(lines, raw.headers["x-request-id"])
    assert usage is not None and line["route"] == "/v1/completions"
    assert (int(line["tokens_in"]), int(line["tokens_out"])) == (usage.prompt_tokens, usage.completion_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_line_has_the_message_usage(claude, lines, stream):
    ask = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        with claude.messages.stream(**ask) as events:
            message = events.get_final_message()
            request_id = events.response.headers["x-request-id"]
    else:
        raw = claude.messages.with_raw_response.create(**ask)
        message, request_id = raw.parse(), raw.headers["x-request-id"]
    line = line_for(lines, request_id)
    assert line["route"] == "/v1/messages" and message.usage.cache_read_input_tokens is not None
    # Anthropic counts the cached part of the prompt apart from input_tokens.
    assert int(line["tokens_in"]) == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert int(line["tokens_out"]) == message.usage.output_tokens


def test_a_streamed_response_line_has_its_usage(oai, lines):
    with oai.responses.with_streaming_response.create(model="tiny", input=PROMPT, max_output_tokens=4,
                                                      stream=True) as raw:
        done = [e for e in raw.parse() if e.type in ("response.completed", "response.incomplete")][-1]
        request_id = raw.headers["x-request-id"]
    line = line_for(lines, request_id)
    assert done.response.usage is not None and line["route"] == "/v1/responses"
    assert (int(line["tokens_in"]), int(line["tokens_out"])) == (done.response.usage.input_tokens,
                                                                 done.response.usage.output_tokens)


@pytest.mark.parametrize(("method", "path", "headers", "body", "status", "route"), [
    ("GET", "/v1/models", {"Authorization": f"Bearer {KEY}"}, None, "200", "/v1/models"),
    ("GET", "/v1/models/tiny", {"Authorization": f"Bearer {KEY}"}, None, "200", "/v1/models/{model_id:path}"),
    ("GET", "/health", {}, None, "200", "/health"),
    ("POST", "/v1/chat/completions", {"Authorization": "Bearer wrong"}, {}, "401", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}, {"model": "tiny"}, "400",
     "/v1/chat/completions"),
    ("GET", "/no/such/path", {}, None, "404", "/no/such/path"),
], ids=["models", "model", "health", "401", "400", "404"])
def test_every_request_gets_a_line(server, lines, method, path, headers, body, status, route):
    r = httpx.request(method, server.url + path, headers=headers, json=body, timeout=60)
    line = line_for(lines, r.headers["x-request-id"])
    assert (line["method"], line["route"], line["status"]) == (method, route, status)
    assert str(r.status_code) == status and (line["tokens_in"], line["tokens_out"]) == ("-", "-")


def test_a_long_path_is_cut_short(server, lines):
    r = httpx.get(server.url + "/x" * 200, timeout=60)
    line = line_for(lines, r.headers["x-request-id"])
    assert len(line["route"]) == access_log.MAX_ROUTE_CHARS and line["route"].endswith("...")


@pytest.mark.parametrize(("given", "kept"), [("client-id.42", True), ("two words", False),
                                             ("x\" 200 1.0s in=1", False), ("a" * 129, False)])
def test_a_clients_request_id_is_kept_when_it_is_a_plain_token(server, lines, given, kept):
    r = httpx.get(server.url + "/health", headers={"X-Request-Id": given}, timeout=60)
    assert (r.headers["x-request-id"] == given) == kept and r.headers["request-id"] == r.headers["x-request-id"]
    line_for(lines, r.headers["x-request-id"])


def test_json_lines(caplog):
    caplog.set_level(logging.INFO, logger="lmport.access")
    server = start("json")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=3)
        usage = raw.parse().usage
        request_id = raw.headers["x-request-id"]
        deadline = time.monotonic() + 30
        while not (found := [json.loads(r.getMessage()) for r in caplog.records
                             if r.name == "lmport.access" and request_id in r.getMessage()]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        server.stop()
    line = found[0]
    assert usage is not None and set(line) == {"time", "method", "route", "status", "latency_s", "tokens_in",
                                               "tokens_out", "request_id", "client"}
    assert (line["method"], line["route"], line["status"]) == ("POST", "/v1/chat/completions", 200)
    assert (line["tokens_in"], line["tokens_out"]) == (usage.prompt_tokens, usage.completion_tokens)


def test_off_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="lmport.access")
    server = start(None)
    try:
        r = httpx.get(server.url + "/health", timeout=60)
    finally:
        server.stop()   # the answer has been sent and the server has stopped: a line would be there by now
    assert r.status_code == 200 and "x-request-id" not in r.headers
    assert not [record for record in caplog.records if record.name == "lmport.access"]


def test_serve_flags():
    parse = build_parser().parse_args
    default, json_lines, off = (parse(["serve", *flags]) for flags in (
        [], ["--access-log-format", "json"], ["--no-access-log"]))
    assert (default.access_log, default.access_log_format) == (True, "plain")
    assert (json_lines.access_log, json_lines.access_log_format) == (True, "json")
    assert off.access_log is False
    with pytest.raises(SystemExit):
        parse(["serve", "--access-log-format", "xml"])


@pytest.mark.parametrize("fmt", ["plain", "json", None])
def test_serve_sends_lines_to_stderr_whatever_the_log_level(fmt, capsys):
    logger = logging.getLogger("lmport.access")
    saved = logger.handlers[:], logger.propagate, logger.level
    try:
        access_log.configure(fmt)
        logger.info("a line")
        assert ("a line" in capsys.readouterr().err) == (fmt is not None)
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])
