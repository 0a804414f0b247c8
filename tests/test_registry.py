"""Backend discovery and selection: entry points, stevedore, duplicates, plugins that fail to load."""
from __future__ import annotations

import logging
import re

import pytest

from lmport import ConfigError, EngineConfig

from lmport.entrypoints import cli

from lmport.platform import registry
from lmport.backends.cpu import CpuBackend
from lmport.platform.resolution import resolve_config

IN_TREE = {"ascend", "camb", "cpu", "cuda"}


def test_backend_names_lists_in_tree_backends_sorted():
    names = registry.backend_names()
    assert IN_TREE <= set(names)
    assert names == sorted(set(names))


def test_selection_goes_through_stevedore(monkeypatch):
    calls = []
    real = registry.DriverManager

    def spy(namespace, name, **kwargs):
        calls.append((namespace, name))
        return real(namespace, name, **kwargs)

    monkeypatch.setattr(registry, "DriverManager", spy)
    assert registry.load_backend_class("cpu") is CpuBackend
    assert calls == [("lmport.backends", "cpu")]


def test_unknown_backend_lists_installed_ones():
    with pytest.raises(registry.BackendError) as info:
        registry.load_backend_class("tpu")
    for name in registry.backend_names():
        assert name in str(info.value)


FORK = """
from lmport.backends.cpu import CpuBackend

class ForkedCpuBackend(CpuBackend):
    pass
"""


@pytest.mark.parametrize("value", ["lmport.backends.cpu:CpuBackend", "fake_cpu_fork:ForkedCpuBackend"],
                         ids=["same-class", "other-class"])
def test_duplicate_name_from_two_distributions_is_an_error(install_fake_plugin, freeze_discovery, value):
    install_fake_plugin("lmport-cpu-fork", {"cpu": value}, {"fake_cpu_fork": FORK})
    assert registry.backend_names().count("cpu") == 1
    assert len(freeze_discovery()["cpu"]) == 2

    with pytest.raises(registry.BackendError) as info:
        registry.load_backend_class("cpu")
    message = str(info.value)
    assert "more than once" in message and "lmport-cpu-fork" in message and "(lmport)" in message, message
    with pytest.raises(ConfigError, match="more than once"):
        resolve_config(EngineConfig(device_type="cpu"))
    assert registry.backend_origin("cpu") == "lmport, lmport-cpu-fork"

    report = {r.name: r for r in registry.describe_backends()}["cpu"]
    assert report.capabilities is None and report.probe.available is False
    assert "more than once" in report.probe.reason


BROKEN_PLUGINS = {
    # kind: (entry point value, module source, exception type, message)
    "missing-sdk": ("fake_broken_plugin:BrokenBackend", "import torch_fictional_sdk\n",
                    "ModuleNotFoundError", "No module named 'torch_fictional_sdk'"),
    "raises-on-import": ("fake_broken_plugin:BrokenBackend",
                         "raise RuntimeError('libfictional.so: cannot open shared object file')\n",
                         "RuntimeError", "libfictional.so: cannot open shared object file"),
    "missing-class": ("fake_broken_plugin:NoSuchBackend", "x = 1\n",
                      "AttributeError", "module 'fake_broken_plugin' has no attribute 'NoSuchBackend'"),
    "not-a-backend": ("fake_broken_plugin:BrokenBackend", "class BrokenBackend:\n    pass\n",
                      None, "is not a lmport Backend"),
    "name-mismatch": ("fake_broken_plugin:BrokenBackend", """
        from lmport.platform.backend import Backend, Capabilities

        class BrokenBackend(Backend):
            capabilities = Capabilities(device_type="other", torch_device="cpu", kv_quant_policies=frozenset({0}),
                                        default_block_size=16, dist_backend="gloo", priority=0)
        """, None, "declares device_type 'other'"),
}


def _summary(kind: str) -> str:
    """What the report must show: the exception type and message, as a traceback's last line has them."""
    _, _, exc_type, message = BROKEN_PLUGINS[kind]
    return f"{exc_type}: {message}" if exc_type else message


@pytest.mark.parametrize("kind", sorted(BROKEN_PLUGINS))
def test_plugin_that_fails_to_load_is_reported(install_fake_plugin, freeze_discovery, kind, capsys, caplog):
    value, source, _, message = BROKEN_PLUGINS[kind]
    expected = _summary(kind)
    install_fake_plugin("lmport-broken-device", {"broken": value}, {"fake_broken_plugin": source})
    assert "broken" in registry.backend_names()
    freeze_discovery()

    with pytest.raises(registry.BackendError, match=re.escape(message)):
        registry.load_backend_class("broken")
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        resolve_config(EngineConfig(device_type="broken"))
    assert "broken" in str(info.value)

    reports = {r.name: r for r in registry.describe_backends()}
    report = reports["broken"]
    assert report.origin == "lmport-broken-device"
    assert report.capabilities is None and report.probe.available is False
    assert expected in report.probe.reason, report.probe.reason
    assert reports["cpu"].probe.available, "one broken plugin must not hide the others"

    with caplog.at_level(logging.INFO, logger="lmport.platform.registry"):
        assert registry.select_auto().capabilities.device_type != "broken"
    assert "passing over broken" in caplog.text

    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^broken\s+no\s+-\s+-\s+-\s+-\s+-\s+lmport-broken-device$", out, re.M), out
    reason = re.search(r"^\s+broken: (.*)$", out, re.M)
    assert reason and expected in reason.group(1), out


def test_lmport_backends_command_reports_a_plugin_that_fails_to_import(broken_plugin_backends_output,
                                                                       parse_backends):
    """The real command, with a plugin whose module imports a missing SDK (BROKEN_CLI_PLUGIN in conftest)."""
    rows, reasons = parse_backends(broken_plugin_backends_output)
    assert rows["broken"]["available"] == "no"
    assert rows["broken"]["origin"] == "lmport-broken-device"
    assert "failed to load: ModuleNotFoundError: No module named 'torch_fictional_sdk'" in reasons["broken"]
    assert rows["cpu"]["available"] == "yes", "one broken plugin must not hide the others"


def test_listing_names_imports_no_backend_module(fresh_interpreter):
    """In a fresh interpreter (FRESH_INTERPRETER_SCRIPT in conftest)."""
    assert IN_TREE <= set(fresh_interpreter["names"])
    assert fresh_interpreter["modules_after_listing"] == [], "listing backends imported backend modules"
    assert fresh_interpreter["vendor_attempts_listing"] == []
    # Selecting one by name loads that one only (with its own submodules).
    loaded = fresh_interpreter["modules_after_loading_cpu"]
    assert "lmport.backends.cpu" in loaded
    assert all(m == "lmport.backends" or m.startswith("lmport.backends.cpu") for m in loaded), loaded
