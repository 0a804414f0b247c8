"""Shared test helpers: the repository root, running the `lmport` command, fake plugin distributions."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


def _lmport_command() -> list[str]:
    """The `lmport` console script of this interpreter's environment (``-m lmport.cli`` if it has none)."""
    script = Path(sys.executable).parent / ("lmport.exe" if os.name == "nt" else "lmport")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmport.cli"]


def _run_lmport(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
                cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([*_lmport_command(), *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=str(cwd) if cwd else None)


@pytest.fixture(scope="session")
def run_lmport():
    """``run_lmport(*args, env=..., cwd=...)``: run the installed `lmport` command in a subprocess."""
    return _run_lmport


def parse_backends_table(text: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Split `lmport backends` output into ({name: {column: cell}}, {name: reason})."""
    table, _, why = text.partition("\nwhy:")
    lines = [line for line in table.splitlines() if line.strip()]
    if not lines:
        raise AssertionError(f"`lmport backends` printed no table:\n{text}")
    header = re.split(r"\s{2,}", lines[0].strip())
    rows = {}
    for line in lines[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(header):
            raise AssertionError(f"row {line!r} does not have the {len(header)} columns {header}")
        row = dict(zip(header, cells))
        rows[row[header[0]]] = row
    reasons = {}
    for line in why.splitlines():
        name, sep, reason = line.strip().partition(": ")
        if sep:
            reasons[name] = reason
    return rows, reasons


@pytest.fixture(scope="session")
def parse_backends():
    """``parse_backends(text)``: see :func:`parse_backends_table`."""
    return parse_backends_table


@pytest.fixture(scope="session")
def backends_output() -> str:
    """Stdout of one real `lmport backends` run, shared by the tests that read it."""
    proc = _run_lmport("backends")
    if proc.returncode != 0:
        pytest.fail(f"`lmport backends` exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="session")
def backends_table(backends_output):
    """The parsed `lmport backends` output: ({name: {column: cell}}, {name: reason})."""
    return parse_backends_table(backends_output)


@pytest.fixture
def install_fake_plugin(tmp_path, monkeypatch):
    """``install_fake_plugin(dist, {name: "module:attr"}, {module: source})``.

    Installs a fake plugin distribution for this test only: a ``*.dist-info``
    with ``lmport.backends`` entry points (plus its modules) in a fresh folder
    prepended to ``sys.path``, so importlib.metadata and stevedore both find it
    exactly as they find a pip-installed plugin. Returns the folder, usable as
    PYTHONPATH for a subprocess. Everything is undone after the test.
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
        site = tmp_path / f"site{count}"
        info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            "[lmport.backends]\n" + "".join(f"{name} = {value}\n" for name, value in entry_points.items()))
        for module, source in (sources or {}).items():
            (site / f"{module}.py").write_text(textwrap.dedent(source))
            modules.append(module)
        monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()
        return site

    yield install
    for module in modules:
        sys.modules.pop(module, None)
