"""The fixtures every test module can ask for by name (tests/conftest.py imports them): the background
runs of the `lmport` command and a fresh interpreter, the repository root, and fake plugin
distributions installed for one test."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from support.background_runs import completed
from support.cli_helpers import parse_backends_table, write_fake_distribution

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def backends_output() -> str:
    """Stdout of one real `lmport backends` run (the installed console script)."""
    return completed("backends_output").stdout


@pytest.fixture(scope="session")
def broken_plugin_backends_output() -> str:
    """Stdout of `lmport backends` with BROKEN_CLI_PLUGIN (whose module fails to import) installed."""
    return completed("broken_plugin_backends_output").stdout


@pytest.fixture(scope="session")
def fresh_interpreter() -> dict:
    """FRESH_INTERPRETER_SCRIPT's findings: what listing and loading import, per-backend load and probe."""
    import json
    return json.loads(completed("fresh_interpreter").stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def backends_table(backends_output):
    """The parsed `lmport backends` output: ({name: {column: cell}}, {name: reason})."""
    return parse_backends_table(backends_output)


@pytest.fixture(scope="session")
def parse_backends():
    """``parse_backends(text)``: see :func:`parse_backends_table`."""
    return parse_backends_table


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


# -- fake plugins in this process ---------------------------------------------------------------

@pytest.fixture
def freeze_discovery(monkeypatch):
    """``freeze_discovery()``: scan the entry points now and reuse that scan for the rest of the test.

    Each scan reads every installed distribution (~20 ms) and one describe_backends()
    makes a dozen; call it once the test has checked discovery itself.
    """
    from lmport.platform import registry

    def freeze():
        found = registry._entry_points()
        monkeypatch.setattr(registry, "_entry_points", lambda: found)
        return found

    return freeze


@pytest.fixture
def install_fake_plugin(tmp_path, monkeypatch):
    """``install_fake_plugin(dist, {name: "module:attr"}, {module: source})``.

    Installs a fake plugin distribution for this test only, in a fresh folder
    prepended to ``sys.path``, so importlib.metadata and stevedore both find it
    exactly as they find a pip-installed plugin. Returns the folder. Undone
    after the test.
    """
    import stevedore._cache as stevedore_cache
    from stevedore import ExtensionManager

    # stevedore caches entry points per namespace for the life of the process, and
    # on disk per sys.path: give this test a fresh in-memory cache and no disk writes.
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    monkeypatch.setattr(stevedore_cache._c, "_disable_caching", True, raising=False)
    modules: list[str] = []
    count = 0

    def install(dist: str, entry_points: dict[str, str], sources: dict[str, str] | None = None) -> Path:
        nonlocal count
        count += 1
        # A new folder for each call: stevedore caches entry points per sys.path value.
        site = write_fake_distribution(tmp_path / f"site{count}", dist, entry_points, sources)
        modules.extend(sources or {})
        monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()
        return site

    yield install
    for module in modules:
        sys.modules.pop(module, None)
