"""Issue 35's remaining reliability items: prefix-cache isolation (cache_salt, salting by API key), clients that
never read, bounded echo scoring, the grammar mask budget, and bounded prefill steps with admission by choices.
"""
from __future__ import annotations

import httpx
import pytest

from lmport.config import EngineConfig
from lmport.engine import Engine
from lmport.server.app import create_app
from models import tiny_model_dir
from test_server import ServerThread

KEYS = ["key-a", "key-b"]
PROMPT = " ".join(f"w{i}" for i in range(200))   # several KV blocks


@pytest.fixture(scope="module")
def cached():
    """Prefix caching on, two API keys, prefix-cache blocks salted by key."""
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=256, session_len=1024,
                                                          block_size=16, enable_prefix_caching=True))
    server = ServerThread(create_app(engine, model_name="tiny", api_key=KEYS, cache_salt_by_api_key=True))
    server.engine = engine
    yield server
    server.stop()


def cached_tokens(server, key: str, **fields) -> int:
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_and_api_key_key_the_prefix_cache(cached):
    cached_tokens(cached, "key-a")
    assert cached_tokens(cached, "key-a") > 0                       # same key, no salt: a hit
    assert cached_tokens(cached, "key-b") == 0                      # another key never hits key-a's blocks
    assert cached_tokens(cached, "key-a", cache_salt="s1") == 0     # a new salt is a new cache
    assert cached_tokens(cached, "key-a", cache_salt="s1") > 0
    assert cached_tokens(cached, "key-b", cache_salt="s1") == 0     # the same salt under another key
    r = httpx.post(cached.url + "/v1/completions", headers={"Authorization": "Bearer key-c"},
                   json={"model": "tiny", "prompt": "a"})
    assert r.status_code == 401
    r = httpx.post(cached.url + "/v1/completions", headers={"Authorization": "Bearer key-a"},
                   json={"model": "tiny", "prompt": "a", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_cache_salt_alone_separates_requests():
    from lmport.server.serving import Server
    engine = Engine(tiny_model_dir("llama"), EngineConfig(cache_max_entry_count=64, session_len=512))
    server = Server(engine, "tiny")
    try:
        assert server.cache_salt("s", "key-a") == "s" and server.cache_salt(None, None) is None
        server.cache_salt_by_api_key = True
        assert server.cache_salt("s", "key-a") != server.cache_salt("s", "key-b")
        assert server.cache_salt("s", "key-a") != server.cache_salt(None, "key-a")
    finally:
        server.loop.shutdown()
