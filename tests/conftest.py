"""Shared test helpers: running the `lmport` command, fresh interpreters, fake plugin distributions.

A fresh interpreter spends seconds importing torch, so the few checks that
need one run as background subprocesses started as soon as collection is
done (only when a collected test asks for their fixture); the tests that read
them wait for the result.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

# Without a GPU the cuda backend's Triton kernels run on CPU tensors under the interpreter. Triton reads the
# switch when the kernels are first imported, so the test session sets it here, before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
# Vendor stacks a backend module must import neither to load nor to read its Capabilities.
VENDOR_SDKS = ("torch_npu", "torch_mlu", "torch_mlu_ops", "triton")


def lmport_command() -> list[str]:
    """The `lmport` console script of this interpreter's environment (``-m lmport.cli`` if it has none)."""
    script = Path(sys.executable).parent / ("lmport.exe" if os.name == "nt" else "lmport")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmport.cli"]


def write_fake_distribution(site: Path, dist: str, entry_points: dict[str, str],
                            sources: dict[str, str] | None = None) -> Path:
    """Write an installed-looking distribution into ``site``: a dist-info with
    ``lmport.backends`` entry points, plus its modules. Put ``site`` on the path to install it."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[lmport.backends]\n" + "".join(f"{name} = {value}\n" for name, value in entry_points.items()))
    for module, source in (sources or {}).items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    return site


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


# -- background subprocesses ------------------------------------------------------------------

# In a fresh interpreter where the vendor SDKs cannot be imported (even on a
# machine that has them): list the backends and see that nothing was imported,
# load cpu alone, then load every backend, read its Capabilities, and probe it.
FRESH_INTERPRETER_SCRIPT = r"""
import importlib.abc, json, sys
VENDOR = __VENDOR_SDKS__

class BlockVendorSDKs(importlib.abc.MetaPathFinder):
    attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in VENDOR:
            self.attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, BlockVendorSDKs())
attempts = BlockVendorSDKs.attempts
import torch
from lmport import registry

eps = registry._entry_points()
plugin_modules = {ep.value.split(":")[0].split(".")[0] for group in eps.values() for ep in group} - {"lmport"}

def backend_modules():
    return sorted(m for m in sys.modules if m.startswith("lmport.backends")
                  or m.split(".")[0] in plugin_modules | set(VENDOR))

attempts.clear()
names = registry.backend_names()
origins = {name: registry.backend_origin(name) for name in names}
out = {"names": names, "modules_after_listing": backend_modules(), "vendor_attempts_listing": list(attempts)}
attempts.clear()
registry.load_backend_class("cpu")
first_load_attempts = {"cpu": list(attempts)}
out["modules_after_loading_cpu"] = backend_modules()
out["backends"] = {}
for name in names:
    attempts.clear()
    try:
        cls = registry.load_backend_class(name)
        caps = cls.capabilities
        entry = {"ok": True, "device_type": caps.device_type,
                 "vendor_import_attempts": first_load_attempts.get(name, list(attempts)),
                 "vendor_imported": sorted(m for m in sys.modules if m.split(".")[0] in VENDOR),
                 "cuda_initialized": torch.cuda.is_initialized()}
        probe = registry.safe_probe(cls)
        entry.update(available=probe.available, reason=probe.reason)
    except Exception as exc:
        entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out["backends"][name] = entry
print(json.dumps(out))
""".replace("__VENDOR_SDKS__", repr(VENDOR_SDKS))

BROKEN_CLI_PLUGIN = ("lmport-broken-device", {"broken": "fake_broken_cli_plugin:BrokenBackend"},
                     {"fake_broken_cli_plugin": "import torch_fictional_sdk\n"})


class _Background:
    def __init__(self):
        self.jobs: dict[str, subprocess.Popen] = {}
        self.results: dict[str, subprocess.CompletedProcess] = {}
        self._tmp: Path | None = None

    @property
    def tmp(self) -> Path:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="lmport-tests-"))
        return self._tmp

    def _env(self, **extra) -> dict[str, str]:
        # stevedore caches entry points under XDG_CACHE_HOME: keep one-off paths out of the user's cache.
        return dict(os.environ, XDG_CACHE_HOME=str(self.tmp / "cache"), **extra)

    def _argv_env(self, name: str):
        if name == "backends_output":
            return [*lmport_command(), "backends"], self._env()
        if name == "broken_plugin_backends_output":
            site = write_fake_distribution(self.tmp / "broken-site", *BROKEN_CLI_PLUGIN)
            return [*lmport_command(), "backends"], self._env(PYTHONPATH=str(site))
        if name == "fresh_interpreter":
            # torch would import an installed vendor extension itself; that is torch's doing, not lmport's.
            return [sys.executable, "-c", FRESH_INTERPRETER_SCRIPT], self._env(TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        raise KeyError(name)

    names = ("backends_output", "broken_plugin_backends_output", "fresh_interpreter")

    def start(self, name: str) -> None:
        if name not in self.jobs:
            argv, env = self._argv_env(name)
            self.jobs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               env=env, cwd=str(self.tmp))

    def result(self, name: str, timeout: float = 300) -> subprocess.CompletedProcess:
        if name not in self.results:
            self.start(name)
            proc = self.jobs[name]
            out, err = proc.communicate(timeout=timeout)
            self.results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return self.results[name]

    def close(self) -> None:
        for proc in self.jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


_background = _Background()


def _uses_background(item) -> bool:
    return any(name in _background.names for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(session, config, items):
    # The tests that wait for a background subprocess go last, giving it time to finish.
    items.sort(key=_uses_background)


def pytest_collection_finish(session):
    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    for name in _background.names:
        if name in wanted:
            _background.start(name)


def pytest_sessionfinish(session, exitstatus):
    _background.close()


def _completed(name: str) -> subprocess.CompletedProcess:
    proc = _background.result(name)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, proc.args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def backends_output() -> str:
    """Stdout of one real `lmport backends` run (the installed console script)."""
    return _completed("backends_output").stdout


@pytest.fixture(scope="session")
def broken_plugin_backends_output() -> str:
    """Stdout of `lmport backends` with BROKEN_CLI_PLUGIN (whose module fails to import) installed."""
    return _completed("broken_plugin_backends_output").stdout


@pytest.fixture(scope="session")
def fresh_interpreter() -> dict:
    """FRESH_INTERPRETER_SCRIPT's findings: what listing and loading import, per-backend load and probe."""
    import json
    return json.loads(_completed("fresh_interpreter").stdout.strip().splitlines()[-1])


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
    from lmport import registry

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
