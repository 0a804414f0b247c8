"""Chat templates: one given at start-up (--chat-template, a file or the text), and a model without one, whose
chat requests are refused with an error that says what to do instead of being joined into a prompt some other
way (the model's card in /v1/models says it has none)."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest
from support.chat_families import TEMPLATES, ServerThread
from support.model_helpers import tiny_model_dir

from lmport.entrypoints.api import encode_prompt
from lmport.chat_template import load
from lmport.config import ConfigError, EngineConfig
from lmport.engine.engine import Engine, RequestError
from lmport.server.app import create_app
from lmport.server.chat_format import configure, load_template

QWEN3 = TEMPLATES / "Qwen-Qwen3-0.6B.jinja"


def test_a_template_is_read_from_its_file_or_given_inline():
    assert load(str(QWEN3)) == QWEN3.read_text()
    assert load("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        load("chatml.jinja")
    with pytest.raises(ConfigError, match="--chat-template"):
        load_template("no/such/template.jinja")


@pytest.fixture(scope="module")
def bare():
    """A model whose tokenizer has no chat template, and the same model given one with --chat-template."""
    servers = []
    for template in (None, str(QWEN3)):
        engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=64))
        engine.tokenizer.chat_template = None   # the front end's copy is made from it
        servers.append(ServerThread(create_app(engine, model_name="tiny", chat_template=template)))
    yield servers
    for server in servers:
        server.stop()


def test_a_model_without_a_template_refuses_chat_and_says_so(bare):
    server = bare[0]
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["chat_template"] is None
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert caught.value.body["code"] == "no_chat_template" and "--chat-template" in caught.value.body["message"]
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].finish_reason


def test_a_template_given_at_start_up_is_used(bare):
    from transformers import AutoTokenizer
    server = bare[1]
    assert httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["chat_template"] == "given"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    tok.chat_template = QWEN3.read_text()
    assert reply.usage.prompt_tokens == len(tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                                    add_generation_prompt=True, return_dict=False))


def test_start_up_warns_about_a_model_without_a_template(caplog):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    tok.chat_template = None
    with caplog.at_level(logging.WARNING, logger="lmport.server.chat_format"):
        chosen = configure(tok)
    assert chosen.template is None and "--chat-template" in caplog.text


def test_the_python_api_refuses_messages_without_a_template():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    tok.chat_template = None
    assert encode_prompt(tok, "plain text") == tok.encode("plain text")
    with pytest.raises(RequestError, match="no chat template"):
        encode_prompt(tok, [{"role": "user", "content": "Hi"}])
