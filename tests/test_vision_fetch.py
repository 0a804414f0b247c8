"""Images fetched from http(s) URLs by a server started with an allow-list of hosts (``--allowed-media-domains``).

The images come from an HTTP server this test binds on 127.0.0.1, port 0 (no outside network); the same server is
also reached as ``localhost``, a host name that is not on the list. The reference for a fetched image is
transformers' greedy ``generate`` on the same bytes (tests/test_vision_server.py's ``reference``); each refusal is
a 400 naming the image's field and the URL's host, and the image server's log shows what was (not) fetched."""
from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.errors import ConfigError
from lmport.multimodal.images import ImageLimits
from lmport.server.app import create_app
from support.vision_helpers import tiny_qwen2_5_vl_dir
from test_server import ServerThread
from test_vision_server import GREEDY, reference_answer

MAX_BYTES = 64 * 1024
TIMEOUT = 1.0
ENDLESS = 4096 * MAX_BYTES   # where an "endless" reply stops if the client goes on reading


class ImageServer:
    """Serves ``images`` by path on 127.0.0.1 (port 0), and the paths below; ``seen`` lists (host, path) of every
    request it got."""

    def __init__(self, images: dict[str, bytes]):
        self.seen: list[tuple[str, str]] = []
        self.sent: dict[str, int] = {}   # bytes written to each path's replies
        self.release = threading.Event()   # lets a held reply go
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.seen.append((self.headers["Host"].rpartition(":")[0], self.path))
                if self.path in images:
                    self.reply(200, images[self.path], "image/png")
                elif self.path == "/to-localhost":   # a redirect to a host not on the list
                    self.redirect(f"http://localhost:{owner.port}/cat.png")
                elif self.path == "/to-cat":   # a redirect on the same host
                    self.redirect("/cat.png")
                elif self.path == "/to-file":
                    self.redirect("file:///etc/passwd")
                elif self.path == "/loop":
                    self.redirect("/loop")
                elif self.path == "/large":   # said by its Content-Length
                    self.reply(200, b"\0" * (MAX_BYTES + 1), "image/png")
                elif self.path == "/endless":   # no Content-Length: the body goes on until the client leaves
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    chunk, sent = b"\0" * 16384, 0
                    try:
                        while sent < ENDLESS:
                            self.wfile.write(chunk)
                            sent += len(chunk)
                    except OSError:
                        pass
                    owner.sent[self.path] = sent
                elif self.path == "/gzip":   # compressed though the fetch asks for it as it is
                    body = gzip.compress(images["/cat.png"])
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Encoding", "gzip")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/held":   # no answer until the test lets it go
                    owner.release.wait(30)
                    self.reply(200, images["/cat.png"], "image/png")
                else:
                    self.reply(404, b"not here", "text/plain")

            def reply(self, status: int, body: bytes, kind: str):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

            def redirect(self, location: str):
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def stop(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def model_dir():
    return tiny_qwen2_5_vl_dir()


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_answer(model_dir)


@pytest.fixture(scope="module")
def images(reference):
    parts = reference[0]
    server = ImageServer({"/cat.png": parts[1]})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(model_dir):
    limits = ImageLimits(max_bytes=MAX_BYTES, allowed_media_domains=frozenset({"127.0.0.1"}),
                         fetch_timeout=TIMEOUT)
    server = ServerThread(create_app(Engine(model_dir, EngineConfig(device_type="cpu", dtype="float32",
                                                                    cache_max_entry_count=128)),
                                     model_name="tiny-vl", image_limits=limits))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def ask(client, url: str, **options):
    return client.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Look at this:"}, {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"}]}], **(options or {"max_tokens": 2}))


def refusal(client, url: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, url)
    assert err.value.body["param"] == "messages.0.content.1.image_url.url", err.value.body
    return err.value


def test_an_image_from_an_allowed_host_equals_transformers(client, images, reference):
    _, prompt_tokens, text = reference
    reply = ask(client, images.url("/cat.png"), **GREEDY)
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.choices[0].message.content == text
    assert ("127.0.0.1", "/cat.png") in images.seen


def test_a_redirect_on_the_allowed_host_is_followed(client, images):
    assert ask(client, images.url("/to-cat")).usage.completion_tokens >= 1
    assert images.seen[-2:] == [("127.0.0.1", "/to-cat"), ("127.0.0.1", "/cat.png")]


def test_a_host_not_on_the_list_is_refused_without_a_request(client, images):
    before = len(images.seen)
    err = refusal(client, images.url("/cat.png", host="localhost"))
    assert "host 'localhost' is not one this server fetches images from" in err.message
    assert len(images.seen) == before


def test_a_redirect_off_the_list_is_refused_before_it_is_followed(client, images):
    err = refusal(client, images.url("/to-localhost"))
    assert "redirects to host 'localhost'" in err.message and "'127.0.0.1'" in err.message
    assert images.seen[-1] == ("127.0.0.1", "/to-localhost")   # localhost was never asked
    assert "redirects to a file: URL" in refusal(client, images.url("/to-file")).message
    assert "redirects more than 5 times" in refusal(client, images.url("/loop")).message


@pytest.mark.parametrize("path, words", [
    ("/large", "its Content-Length is 65537"),
    ("/endless", f"more than {MAX_BYTES} bytes arrived"),
])
def test_an_image_over_the_byte_limit_is_refused_while_it_arrives(client, images, path, words):
    err = refusal(client, images.url(path))
    assert f"the image from host '127.0.0.1' is larger than the server's limit of {MAX_BYTES} bytes" in err.message
    assert words in err.message
    if path == "/endless":   # the fetch stopped reading: the reply was cut off far short of its end
        deadline = time.monotonic() + 30
        while path not in images.sent and time.monotonic() < deadline:
            time.sleep(0.05)
        assert images.sent[path] < ENDLESS // 16, images.sent


def test_a_compressed_reply_is_refused(client, images):
    """A compressed body would grow past the byte limit after it was counted; the fetch asks for none."""
    assert "with content encoding 'gzip'" in refusal(client, images.url("/gzip")).message


def test_a_fetch_that_takes_too_long_is_refused(client, images):
    err = refusal(client, images.url("/held"))
    assert f"fetching the image from host '127.0.0.1' took more than {TIMEOUT:g} s" in err.message


def test_a_failed_fetch_names_the_host_and_the_status(client, images):
    assert "from host '127.0.0.1' failed: HTTP 404" in refusal(client, images.url("/missing")).message
    with socket_closed() as port:   # nothing listens there
        assert "from host '127.0.0.1' failed (ConnectError" in refusal(client, f"http://127.0.0.1:{port}/a.png").message


def socket_closed():
    """A port on 127.0.0.1 that nothing listens on (bound, never listening, for the test's length)."""
    import contextlib
    import socket

    @contextlib.contextmanager
    def bound():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        try:
            yield sock.getsockname()[1]
        finally:
            sock.close()
    return bound()


def test_the_responses_api_fetches_an_input_image(server, images, reference):
    _, prompt_tokens, _ = reference
    body = {"model": "tiny-vl", "max_output_tokens": 1, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Look at this:"}, {"type": "input_image", "image_url": images.url("/cat.png"),
                                                          "detail": "auto"},
        {"type": "input_text", "text": "What is it?"}]}]}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == prompt_tokens, r.text
    body["input"][0]["content"][1]["image_url"] = images.url("/cat.png", host="localhost")
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.1.image_url", r.text
    assert "host 'localhost'" in r.json()["error"]["message"]


def test_the_messages_api_fetches_a_url_image_source(server, images, reference):
    """Anthropic's ``{"type": "url"}`` image source, fetched as a chat image URL is; a refusal names the source's
    url field."""
    _, prompt_tokens, text = reference
    block = {"type": "image", "source": {"type": "url", "url": images.url("/cat.png")}}
    body = {"model": "tiny-vl", "max_tokens": GREEDY["max_tokens"], "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Look at this:"}, block, {"type": "text", "text": "What is it?"}]}]}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == prompt_tokens and r.json()["content"][0]["text"] == text
    block["source"]["url"] = images.url("/cat.png", host="localhost")
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 400 and "host 'localhost'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["message"].startswith("messages.0.content.1.source.url"), r.text


def test_the_server_serves_on_after_refused_fetches(client, images):
    for path in ("/missing", "/large", "/to-localhost"):
        refusal(client, images.url(path))
    assert ask(client, images.url("/cat.png")).usage.completion_tokens >= 1


@pytest.mark.parametrize("hosts", [{"https://images.example.com"}, {"images.example.com/cats"}, {""},
                                   "images.example.com"])
def test_an_allow_list_entry_that_is_not_a_host_name_is_refused(hosts):
    with pytest.raises(ConfigError, match="host name"):
        ImageLimits(allowed_media_domains=hosts)


def test_allow_list_entries_match_as_host_names_do():
    assert ImageLimits(allowed_media_domains=frozenset({"Images.Example.COM.", "[::1]"})).allowed_media_domains == \
        {"images.example.com", "::1"}
