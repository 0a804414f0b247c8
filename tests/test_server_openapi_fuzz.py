"""The server's OpenAPI document (/openapi.json).

In `make test`: the document is well formed (every route of the app is in it with its methods, every schema is a
valid JSON Schema, every reference resolves). Slow: schemathesis over it (tools/openapi_fuzz.py: every
route, all checks, no failure; a server and a few hundred requests). The script installs the pinned schemathesis
in its own virtualenv under ~/.cache/lmport-tests/ on first use (minutes, once), unless $LMPORT_SCHEMATHESIS
names a schemathesis executable to use instead.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from support.model_helpers import tiny_tool_model_dir

ROOT = Path(__file__).resolve().parents[1]


def _refs(node):
    """Every "$ref" in ``node``, at any depth."""
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_the_document_lists_every_route_and_its_schemas_are_valid():
    app = create_app(Engine(tiny_tool_model_dir(), EngineConfig(cache_max_entry_count=16, session_len=128)),
                     model_name="tiny")
    with TestClient(app) as client:   # leaving it runs the app's shutdown, which stops the engine
        r = client.get("/openapi.json")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["openapi"].startswith("3.1.")
    # The routes as the app serves them: each route module's APIRouter included in it.
    routes = {(ctx.path_format, method.lower()) for ctx in iter_route_contexts(app.routes)
              if isinstance(ctx.original_route, APIRoute) and ctx.original_route.include_in_schema
              for method in ctx.original_route.methods}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"} <= {path for path, _ in routes}
    assert {(path, method) for path, ops in doc["paths"].items() for method in ops} == routes
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["responses"], (path, method)
            declared = {p["name"] for p in op.get("parameters", ()) if p["in"] == "path"}
            assert declared == set(re.findall(r"{(\w+)}", path)), (path, method)
    schemas = doc["components"]["schemas"]
    for schema in schemas.values():   # OpenAPI 3.1's schemas are JSON Schema 2020-12
        jsonschema.Draft202012Validator.check_schema(schema)
    dangling = {ref for ref in _refs(doc) if ref.removeprefix("#/components/schemas/") not in schemas}
    assert not dangling


@pytest.mark.slow
@pytest.mark.timeout(1800)   # a few hundred requests on a shared CPU, and the first run installs schemathesis
def test_schemathesis_finds_no_failure():
    # Its own process group: whatever ends the test (a failure, the timeout) ends the server and schemathesis too.
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "openapi_fuzz.py"), "--max-examples", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-6000:] + err[-3000:]
