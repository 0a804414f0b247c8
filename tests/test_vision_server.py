"""Images through the HTTP server: OpenAI chat ``image_url`` parts with data: URLs, Responses ``input_image`` parts
and Anthropic ``image`` blocks, sent by the official ``openai`` and ``anthropic`` clients to a tiny random-weight
Qwen2.5-VL, and the image limits as `lmport serve` flags.

The reference is transformers' greedy ``generate`` on the same checkpoint and images (tests/test_vision.py builds
its inputs); bad images, an http URL, too many images and a text-only model each get a 400 naming the problem,
and the server goes on serving. The request body's limit makes room for the images a request may send: an image
under the per-image limit is never refused for the body's size. (Fetched URLs: tests/test_vision_fetch.py.)"""
from __future__ import annotations

import base64
import re
import struct
import zlib

import anthropic
import httpx
import openai
import pytest
import torch

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.multimodal.images import ImageLimits
from lmport.server.app import create_app
from lmport.server.frontend import MAX_BODY_BYTES
from support.cli_helpers import lmport_command
from support.model_helpers import tiny_model_dir
from support.serve_process import ServeProcess
from support.vision_helpers import data_url, png, tiny_qwen2_5_vl_dir
from test_server import ServerThread
from test_vision import NEW_TOKENS, reference_inputs, reference_tokens

GREEDY = {"temperature": 0, "max_tokens": NEW_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir():
    return tiny_qwen2_5_vl_dir()


@pytest.fixture(scope="module")
def server(model_dir):
    app = create_app(Engine(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=128)),
                     model_name="tiny-vl")
    server = ServerThread(app)
    server.frontend = app.state.frontend
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_answer(model_dir)


def reference_answer(model_dir):
    """A message of text, an image, text; and transformers' prompt length and greedy text for it."""
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


def responses_content(parts, detail: str = "auto") -> list[dict]:
    return [{"type": "input_text", "text": p} if isinstance(p, str) else
            {"type": "input_image", "image_url": data_url(p), "detail": detail} for p in parts]


@pytest.mark.parametrize("detail", ["auto", "low"])
def test_responses_input_image_equals_transformers(client, reference, detail):
    """``detail`` is accepted and changes nothing: the model's image processor sizes the image."""
    parts, prompt_tokens, text = reference
    r = client.responses.create(model="tiny-vl", input=[{"role": "user", "content": responses_content(parts, detail)}],
                                max_output_tokens=NEW_TOKENS, temperature=0)
    assert r.usage.input_tokens == prompt_tokens and r.usage.output_tokens == NEW_TOKENS
    assert r.output_text == text


def test_responses_input_tokens_count_the_images_tokens(server, reference):
    parts, prompt_tokens, _ = reference
    r = httpx.post(server.url + "/v1/responses/input_tokens", json={"model": "tiny-vl", "input": [
        {"role": "user", "content": responses_content(parts)}]}, timeout=120)
    assert r.status_code == 200 and r.json()["input_tokens"] == prompt_tokens, r.text


RESPONSES_BAD = {
    "in an assistant message": ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "input_image", "image_url": data_url(png(60, 60))}]}], "input.1.content.0", "belong in user messages"),
    "a stored file": ([{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                                    {"type": "input_image", "file_id": "file-1"}]}],
                      "input.0.content.1.file_id", "stores no files"),
    "no image": ([{"role": "user", "content": [{"type": "input_image"}]}], "input.0.content.0.image_url", "missing"),
    "in a function call output": ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                   {"type": "function_call_output", "call_id": "c1", "output": [
                                       {"type": "input_image", "image_url": data_url(png(60, 60))}]}],
                                  "input.1.output.0", "belong in user messages"),
    # Refused where the chat path decodes the image: named as this API names the field, after the instructions'
    # system message and an earlier message moved its index in the chat request.
    "corrupt": ([{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "input_text", "text": "and"}, {"type": "input_image", "image_url": data_url(png(64, 64, 5)[:200])}]}],
        "input.1.content.1.image_url", "corrupt"),
    "http URL": ([{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}],
                 "input.0.content.0.image_url", "does not fetch images"),
}


@pytest.mark.parametrize("case", RESPONSES_BAD)
def test_responses_bad_images_name_the_input_field(server, case):
    items, param, words = RESPONSES_BAD[case]
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny-vl", "instructions": "Be brief.",
                                                       "max_output_tokens": 2, "input": items}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and words in error["message"], error


def test_an_image_over_the_text_body_limit_is_answered(client):
    """The body's limit grows by the images a request may send, so an image that alone is larger than the limit
    of a text request, and under the per-image limit, is answered."""
    image = png(1000, 1000, 4)
    assert len(image) > MAX_BODY_BYTES
    reply = client.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": openai_content(
        ("What is it?", image))}], max_tokens=1)
    assert reply.usage.completion_tokens == 1


def test_an_image_over_the_per_image_limit_gets_the_per_image_400(client):
    limit = ImageLimits().max_bytes
    with pytest.raises(openai.BadRequestError, match=f"{limit + 1} bytes is more than the server's limit of {limit}"):
        client.chat.completions.create(model="tiny-vl", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(bytes(limit + 1))}}]}])


def test_the_body_limit_follows_the_image_limits(server):
    """Images x bytes in base64, over the text allowance: a body of as many images at the limit passes the body's
    check (to the images' own), one byte more is a 413."""
    server.frontend.image_limits = ImageLimits(max_images=2, max_bytes=2**20)
    try:
        def post(images: list[bytes], text: str = "hi"):
            return httpx.post(server.url + "/v1/chat/completions", json={
                "model": "tiny-vl", "max_tokens": 1, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": data_url(image)}}
                                                      for image in images)]}]}, timeout=120)
        at_limit = post([bytes(2**20)] * 2)   # 2 MiB of images, more than 2 MiB of body
        assert at_limit.status_code == 400 and "not an image Pillow can read" in at_limit.text, at_limit.text
        over = post([bytes(2**20 + 1)])
        assert over.status_code == 400 and f"{2**20 + 1} bytes is more than" in over.text, over.text
        body_limit = MAX_BODY_BYTES + 2 * 4 * -(-2**20 // 3)
        too_large = post([], "x" * body_limit)
        assert too_large.status_code == 413 and str(body_limit) in too_large.text, too_large.text
    finally:
        server.frontend.image_limits = ImageLimits()


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


def test_anthropic_url_source_is_refused_without_an_allow_list(server):
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny-vl", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0.content.0.source.url"), r.text
    assert "does not fetch images from URLs" in r.text


def test_a_text_model_answers_400_naming_itself():
    server = ServerThread(create_app(Engine(tiny_model_dir("qwen2"), EngineConfig(device_type="cpu",
                                                                                   cache_max_entry_count=16)),
                                     model_name="tiny-text"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="model 'tiny-text' takes no images"):
            client.chat.completions.create(model="tiny-text", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(png(60, 60))}}]}])
        # A model that takes no images keeps the text body limit.
        r = httpx.post(server.url + "/v1/chat/completions", content=b" " * (MAX_BODY_BYTES + 1),
                       headers={"Content-Type": "application/json"}, timeout=120)
        assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.text, r.text
    finally:
        server.stop()


@pytest.mark.slow   # a server process: its imports and the model's load
def test_lmport_serve_flags_set_the_image_limits(model_dir, tmp_path):
    """`lmport serve` with the image flags: their limits are the server's, and the body limit grows with them."""
    server = ServeProcess(lmport_command(), [model_dir, "--device", "cpu", "--dtype", "float32",
                                             "--cache-max-entry-count", "64", "--max-images-per-request", "1",
                                             "--max-image-bytes", "3MiB", "--max-image-pixels", "1000000"],
                          tmp_path / "serve.log").ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        def ask(*images: bytes):
            return client.chat.completions.create(model=model_dir, max_tokens=1, messages=[{"role": "user", "content":
                                                  openai_content(("What is it?", *images))}])
        image = png(990, 990, 6)
        assert MAX_BODY_BYTES < len(image) <= 3 * 2**20
        assert ask(image).usage.completion_tokens == 1
        for images, words in [((png(60, 60), png(60, 60)), "2 images is more than the server's limit of 1"),
                              ((bytes(3 * 2**20 + 1),), f"is more than the server's limit of {3 * 2**20}"),
                              ((header_only_png(1001, 1000),), "more than the server's limit of 1000000 pixels")]:
            with pytest.raises(openai.BadRequestError, match=words):
                ask(*images)
    finally:
        server.stop()


@pytest.mark.parametrize("flags, words", [
    (["--max-image-bytes", "lots"], "--max-image-bytes 'lots'"),
    (["--max-images-per-request", "0"], "max_images must be a positive number"),
    (["--allowed-media-domains", "https://images.example.com"], "is not a host name"),
])
def test_lmport_serve_refuses_bad_image_flags_before_loading_the_model(flags, words, tmp_path):
    from lmport.entrypoints.cli import build_parser
    from lmport.errors import ConfigError
    from lmport.server.app import serve
    args = build_parser().parse_args(["serve", str(tmp_path / "no-model"), *flags])
    with pytest.raises(ConfigError, match=re.escape(words)):
        serve(args)
