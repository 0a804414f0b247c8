"""The test session's background subprocesses: a fresh interpreter spends seconds importing torch, so
the few checks that need one (`lmport backends`, with and without a broken plugin, and a fresh
interpreter that must import no vendor SDK) start as soon as collection is done (tests/conftest.py)
and the session fixtures that read them wait for the result."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.cli_helpers import lmport_command, write_fake_distribution

# Vendor stacks a backend module must import neither to load nor to read its Capabilities.
VENDOR_SDKS = ("torch_npu", "torch_mlu", "torch_mlu_ops", "triton")

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
from lmport.platform import registry

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


class Background:
    """Subprocesses started once collection is done, read by the session fixtures that need them."""

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


background = Background()


def completed(name: str) -> subprocess.CompletedProcess:
    proc = background.result(name)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, proc.args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc
