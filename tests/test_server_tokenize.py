"""POST /tokenize and POST /detokenize (vLLM's request and response shape), over loopback HTTP.

Two servers run in threads of this process for the module:

- a tiny random-weight Qwen2 GGUF carrying the deepseek-r1-qwen vocabulary of tests/data/gguf_tokenizer (made
  by llama.cpp's converter: control tokens ``<｜User｜>``, ``<｜Assistant｜>``, user-defined ``<think>``, a BOS
  the file adds, ids padded as a real model's, DeepSeek-R1's chat turns): the shape the GGUF tokenizer used to
  get wrong (a BOS past the vocabulary, control tokens split into text), so that every chat failed. A prompt's
  tokens are llama.cpp's as recorded there (with and without the BOS), chat messages give the tokens
  /v1/chat/completions counts as its prompt, and it chats; detokenizing gives back the text;
- a tiny model of a transformers directory: bad bodies get a 400 (404 for a model not served) naming the field.
"""
from __future__ import annotations

import json

import gguf
import httpx
import pytest
import torch

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from support import gguf_files, llama_cpp_tokens
from support.chat_families import ServerThread
from support.model_helpers import tiny_model_dir

RECORDED = json.loads((llama_cpp_tokens.DATA / "llama_cpp_tokens.json").read_text(encoding="utf-8"))["files"]
DEEPSEEK_VOCAB = llama_cpp_tokens.DATA / "deepseek-r1-qwen.gguf"
CHAT = [{"role": "user", "content": "Hi there"}]


def _tokenizer_fields(path) -> tuple:
    reader = gguf.GGUFReader(path)
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[1]) if kind == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), kind, sub))
    return tuple(fields)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny random Qwen2 (float32 GGUF) with the deepseek-r1-qwen vocabulary's tokenizer fields."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    vocab = len(gguf.GGUFReader(DEEPSEEK_VOCAB).fields["tokenizer.ggml.tokens"].data)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp("deepseek-tiny") / "tiny-deepseek-r1-qwen.gguf"
    fields = _tokenizer_fields(DEEPSEEK_VOCAB)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_files, "default_model_tokenizer_fields", lambda: fields)
        gguf_files.write_gguf(path, cfg, model.state_dict(), "F32")
    server = ServerThread(create_app(Engine(str(path), EngineConfig(cache_max_entry_count=64)), model_name="tiny"))
    yield server
    stop(server)


@pytest.fixture(scope="module")
def tiny():
    server = ServerThread(create_app(Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=64)),
                                     model_name="tiny"))
    yield server
    stop(server)


def stop(server) -> None:
    if hasattr(server, "http"):
        server.http.close()
    server.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    if not hasattr(server, "http"):
        server.http = httpx.Client(base_url=server.url, timeout=60)   # one connection for the module's requests
    return server.http.post(path, json=body)


def tokenize(server, **body) -> dict:
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()


def sample(texts: list[str]) -> list[str]:
    """Every 8th text and every special token's (tests/test_gguf_tokenizer.py checks the tokenizer on them all;
    here the route is checked to use it)."""
    return texts[::8] + [t for t in texts if t.startswith("<")]


def test_prompt_tokens_are_llama_cpps(deepseek):
    rec = RECORDED["deepseek-r1-qwen.gguf"]
    want = dict(zip(rec["texts"], rec["ids"]))
    for text in sample(rec["texts"]):
        plain = tokenize(deepseek, model="tiny", prompt=text, add_special_tokens=False)
        assert plain["tokens"] == want[text], text
        assert plain["count"] == len(plain["tokens"])
    for text, ids in list(zip(rec["texts"], rec["ids_add_special"]))[::4]:   # the default adds the file's BOS
        assert tokenize(deepseek, prompt=text)["tokens"] == ids, text
    assert plain["max_model_len"] == httpx.get(deepseek.url + "/v1/models").json()["data"][0]["max_model_len"]


def test_messages_give_the_chat_prompts_tokens_and_it_chats(deepseek):
    """The defect's shape: the control tokens whole, the BOS inside the vocabulary, and a chat that runs."""
    rec = RECORDED["deepseek-r1-qwen.gguf"]
    want = rec["ids"][rec["texts"].index("<｜begin▁of▁sentence｜><｜User｜>Hi there<｜Assistant｜>")]
    assert len(want) == 5   # BOS, User, two words, Assistant
    with_prompt = tokenize(deepseek, messages=CHAT)   # add_generation_prompt: true by default, as vLLM's
    assert with_prompt["tokens"] == want   # the template writes the BOS
    r = post(deepseek, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == with_prompt["count"]
    without = tokenize(deepseek, messages=CHAT, add_generation_prompt=False)
    assert without["tokens"] == want[:-1]
    assert tokenize(deepseek, messages=CHAT, add_special_tokens=True)["tokens"] == want[:1] + want


def test_token_strs_are_the_tokens_texts(deepseek):
    out = tokenize(deepseek, prompt="Hello world", add_special_tokens=False, return_token_strs=True)
    assert "".join(out["token_strs"]).replace("Ġ", " ") == "Hello world"
    assert tokenize(deepseek, prompt="Hello world")["token_strs"] is None


def test_detokenize_gives_the_text_back(deepseek):
    for text in sample(RECORDED["deepseek-r1-qwen.gguf"]["texts"])[::2]:
        ids = tokenize(deepseek, prompt=text, add_special_tokens=False)["tokens"]
        r = post(deepseek, "/detokenize", {"model": "tiny", "tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": text}


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "messages": CHAT}, None),
    ({}, None),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": []}, "messages"),
])
def test_bad_tokenize_bodies_are_refused_by_field(tiny, body, param):
    r = post(tiny, "/tokenize", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if param is None:
        assert "either prompt" in r.json()["error"]["message"]


def test_bad_detokenize_bodies_are_refused_by_field(tiny):
    vocab = httpx.post(tiny.url + "/tokenize", json={"prompt": "x"}, timeout=60)
    assert vocab.status_code == 200
    r = post(tiny, "/detokenize", {"tokens": [1, -1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.1"
    r = post(tiny, "/detokenize", {"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.0"
    r = post(tiny, "/detokenize", {"tokens": "1 2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_a_model_not_served_is_a_404(tiny):
    for path, body in (("/tokenize", {"model": "other", "prompt": "a"}), ("/detokenize", {"model": "other",
                                                                                        "tokens": [1]})):
        r = post(tiny, path, body)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_request_chat_template_is_refused(tiny):
    r = post(tiny, "/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_openapi_describes_the_routes_and_the_replies_conform(tiny):
    import jsonschema
    doc = httpx.get(tiny.url + "/openapi.json", timeout=10).json()
    for path, request, response, body in (
            ("/tokenize", "TokenizeRequest", "TokenizeResponse", {"prompt": "Hello", "return_token_strs": True}),
            ("/detokenize", "DetokenizeRequest", "DetokenizeResponse", {"tokens": [1, 2, 3]}),
            ("/v1/responses/input_tokens", "InputTokensRequest", "InputTokensCount", {"model": "tiny",
                                                                                       "input": "Hello"})):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request)
        assert {"200", "400"} <= set(op["responses"])
        jsonschema.validate(body, {**doc, "$ref": f"#/components/schemas/{request}"})
        reply = post(tiny, path, body)
        assert reply.status_code == 200, reply.text
        jsonschema.validate(reply.json(), {**doc, "$ref": f"#/components/schemas/{response}"})
