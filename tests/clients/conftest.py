"""The client-library suite's session: one `lmport serve` for every test.

The suite runs in the client venvs `make test-clients` builds (tests/clients/run.py), with tests/clients/pytest.ini
as its configuration, so neither tests/conftest.py nor the package's dependencies are needed there. Its files are
named ``client_*.py``: the root run (`make test`) collects none of them, and this file imports nothing beyond the
standard library and pytest.

The server is the one ``LMPORT_CLIENTS_URL`` names (the runner starts one for every venv), else one started here.
"""
from __future__ import annotations

import os

import pytest

from clients.serve import start_server, stop_server


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    """The server's root address, ``http://HOST:PORT``."""
    if url := os.environ.get("LMPORT_CLIENTS_URL"):
        yield url.rstrip("/")
        return
    proc, url = start_server(tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def base_url(server_url) -> str:
    """The OpenAI-style base address, ``http://HOST:PORT/v1``."""
    return server_url + "/v1"
