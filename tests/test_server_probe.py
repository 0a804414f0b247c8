"""The adversarial probe's findings (issue 35, reliability): each case gets a clear answer, no 500, and the
server keeps serving. One server over the tiny random-weight Qwen2 model (a template with special tokens and
tools) runs in a thread of this process for the whole module.
"""
from __future__ import annotations

import json

import httpx
import pytest

from lmport.config import EngineConfig
from lmport.engine import Engine
from lmport.server.app import create_app
from models import tiny_tool_model_dir
from test_server import ServerThread


@pytest.fixture(scope="module")
def server():
    engine = Engine(tiny_tool_model_dir(), EngineConfig(cache_max_entry_count=128, session_len=512))
    server = ServerThread(create_app(engine, model_name="tiny"))
    server.engine = engine
    yield server
    server.stop()


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def chat(content="weather?", **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


DEFS_TOOL = {"type": "function", "function": {"name": "locate", "parameters": {
    "$defs": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
    "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"]}}}


def test_tool_inputs_that_gave_500(server):
    r = post(server, "/v1/chat/completions", chat(tools=[DEFS_TOOL], tool_choice={"type": "function",
                                                                                   "function": "locate"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    for choice in ("required", {"type": "function", "function": {"name": "locate"}}):
        r = post(server, "/v1/chat/completions", chat(tools=[DEFS_TOOL], tool_choice=choice, max_tokens=40))
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"].get("tool_calls")
        if calls:
            assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Lima")
