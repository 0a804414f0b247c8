"""Images through the HTTP server: OpenAI chat ``image_url`` parts with data: URLs and Anthropic ``image`` blocks,
sent by the official ``openai`` and ``anthropic`` clients to a tiny random-weight Qwen2.5-VL.

The reference is transformers' greedy ``generate`` on the same checkpoint and images (tests/test_vision.py builds
its inputs); bad images, an http URL, too many images and a text-only model each get a 400 naming the problem,
and the server goes on serving."""
from __future__ import annotations

import base64
import struct
import zlib

import anthropic
import httpx
import openai
import pytest
import torch

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from support.model_helpers import tiny_model_dir
from support.vision_helpers import data_url, png, tiny_qwen2_5_vl_dir
from test_server import ServerThread
from test_vision import NEW_TOKENS, reference_inputs, reference_tokens

GREEDY = {"temperature": 0, "max_tokens": NEW_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir():
    return tiny_qwen2_5_vl_dir()


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerThread(create_app(Engine(model_dir, EngineConfig(device_type="cpu", dtype="float32",
                                                                    cache_max_entry_count=128)),
                                     model_name="tiny-vl"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' greedy tokens, prompt length and text for a message of text, an image, text."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    parts = ("Look at this:", png(90, 60, 1), "What is it?")
    inputs = reference_inputs(model_dir, tokenizer, parts)
    tokens = reference_tokens(hf, inputs)
    return parts, inputs["input_ids"].shape[1], tokenizer.decode(tokens, skip_special_tokens=True)


def openai_content(parts) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str) else
            {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]


def test_chat_with_a_data_url_equals_transformers(client, reference):
    parts, prompt_tokens, text = reference
    reply = client.chat.completions.create(model="tiny-vl", messages=[{"role": "user",
                                                                       "content": openai_content(parts)}], **GREEDY)
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.choices[0].message.content == text


def test_anthropic_image_block_equals_transformers(server, reference):
    parts, prompt_tokens, text = reference
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(p).decode()}} for p in parts]
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    message = client.messages.create(model="tiny-vl", max_tokens=NEW_TOKENS, messages=[
        {"role": "user", "content": content}], extra_body={"temperature": 0, "ignore_eos": True})
    assert message.usage.input_tokens == prompt_tokens
    assert "".join(b.text for b in message.content if b.type == "text") == text


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels, with no pixel data: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


BAD = {
    "http URL": ("https://example.com/cat.png", "content.1.image_url.url", "does not fetch images"),
    "not base64": ("data:image/png;base64,@@@@", "content.1.image_url.url", "not valid base64"),
    "not an image type": ("data:text/plain;base64,aGk=", "content.1.image_url.url", "not an image"),
    "not an image": (data_url(b"plain text, not a PNG"), "content.1.image_url.url", "not an image Pillow can read"),
    "corrupt": (data_url(png(64, 64, 5)[:200]), "content.1.image_url.url", "corrupt"),
    "20000 x 20000 bomb": (data_url(header_only_png(20000, 20000)), "content.1.image_url.url", "pixels"),
    "5000 x 5000": (data_url(header_only_png(5000, 5000)), "content.1.image_url.url", "5000x5000"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_image_is_a_400_naming_it(case, client):
    url, param, words = BAD[case]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert words in err.value.message and err.value.body["param"] == f"messages.0.{param}"


def test_too_many_images_is_a_400_before_any_is_decoded(client):
    content = [{"type": "image_url", "image_url": {"url": data_url(b"not decoded")}}] * 100
    with pytest.raises(openai.BadRequestError, match="100 images is more than the server's limit of 8"):
        client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": content}])


def test_images_belong_in_user_messages(client):
    with pytest.raises(openai.BadRequestError, match="images belong in user messages"):
        client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(png(60, 60))}}]},
            {"role": "user", "content": "and?"}])


def test_the_server_serves_others_after_bad_images(client):
    for case in BAD:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": BAD[case][0]}}]}])
    reply = client.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": openai_content(
        ("and this?", png(60, 90, 9)))}], max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3


def test_anthropic_url_source_is_refused(server):
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny-vl", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert r.status_code == 400 and "fetches nothing" in r.text


def test_a_text_model_answers_400_naming_itself():
    server = ServerThread(create_app(Engine(tiny_model_dir("qwen2"), EngineConfig(device_type="cpu",
                                                                                   cache_max_entry_count=16)),
                                     model_name="tiny-text"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="model 'tiny-text' takes no images"):
            client.chat.completions.create(model="tiny-text", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(png(60, 60))}}]}])
    finally:
        server.stop()
