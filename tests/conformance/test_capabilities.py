"""Registration, capability declarations and probing, for every installed backend."""
from __future__ import annotations

import dataclasses
import logging
import re
import sys
import types

import pytest
import torch

from lmport.entrypoints import cli

from lmport.platform import registry
from lmport.platform.backend import Backend, Capabilities, ProbeResult

# SDKs present but broken, for probe(); torch's own imports of triton are left alone.
BROKEN_SDKS = ("torch_npu", "torch_mlu", "torch_mlu_ops")
KNOWN_DTYPES = {"float16", "bfloat16", "float32"}

# The capabilities table of docs/backends.md (see docs/architecture.md).
# rule: ("pow2", min) | ("forced", size) | ("any", min).
DOCS_TABLE = {
    "cuda": dict(quant={0, 4, 8}, rule=("pow2", 16), torch_device="cuda", dist="nccl", sdk=None),
    "ascend": dict(quant={0, 4, 8}, rule=("pow2", 16), torch_device="npu", dist="hccl", sdk="torch_npu",
                   default_block_size=128),
    "camb": dict(quant={0}, rule=("forced", 16), torch_device="mlu", dist="cncl", sdk="torch_mlu",
                 default_block_size=16),
    "cpu": dict(quant={0, 4, 8}, rule=("any", 1), torch_device="cpu", dist="gloo", sdk=None),
}


def test_backend_loads_without_vendor_sdk(backend_name, fresh_interpreter):
    """In a fresh interpreter where no vendor SDK (triton included) can be imported: see tests/conftest.py."""
    result = fresh_interpreter["backends"][backend_name]
    assert result["ok"], f"{backend_name} does not load without its vendor SDK: {result.get('error')}"
    assert result["device_type"] == backend_name
    assert result["vendor_import_attempts"] == [], \
        f"loading {backend_name} tried to import {result['vendor_import_attempts']}"
    assert result["vendor_imported"] == [], f"loading {backend_name} imported {result['vendor_imported']}"
    assert result["cuda_initialized"] is False, f"loading {backend_name} initialized CUDA"
    assert isinstance(result["available"], bool) and result["reason"]
    sdk = DOCS_TABLE.get(backend_name, {}).get("sdk")
    if sdk:
        assert result["available"] is False
        assert sdk in result["reason"], result["reason"]


def test_backend_is_registered(backend_name, backend_class):
    assert isinstance(backend_class, type) and issubclass(backend_class, Backend)
    assert backend_name in registry.backend_names()
    assert registry.backend_origin(backend_name) not in ("", "?")


def test_capabilities_is_frozen_dataclass(capabilities):
    assert type(capabilities) is Capabilities
    assert dataclasses.is_dataclass(capabilities)
    assert type(capabilities).__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities.kv_quant_policies = frozenset({0, 4, 8})
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities.block_size_forced = 1
    hash(capabilities)  # every value is immutable too
    assert isinstance(capabilities.kv_quant_policies, frozenset)
    assert isinstance(capabilities.dtypes, tuple)


def test_capabilities_are_sane(backend_name, capabilities):
    c = capabilities
    assert c.device_type == backend_name
    assert isinstance(c.torch_device, str) and re.fullmatch(r"[a-z][a-z0-9_]*(:\d+)?", c.torch_device)
    assert isinstance(c.dist_backend, str) and c.dist_backend
    assert isinstance(c.priority, int) and not isinstance(c.priority, bool)

    assert c.kv_quant_policies <= {0, 4, 8}, c.kv_quant_policies
    assert 0 in c.kv_quant_policies, "every backend must run an unquantized KV cache (quant_policy=0)"
    assert isinstance(c.kv_fp8_formats, frozenset) and c.kv_fp8_formats <= {"e4m3"}, c.kv_fp8_formats

    assert isinstance(c.block_size_min, int) and c.block_size_min >= 1
    assert isinstance(c.default_block_size, int) and c.default_block_size >= 1
    # The default block size passes the backend's own rule (checked here by hand, then by the method).
    if c.block_size_forced is not None:
        assert isinstance(c.block_size_forced, int) and c.block_size_forced >= 1
        assert c.default_block_size == c.block_size_forced
    else:
        assert c.default_block_size >= c.block_size_min
        if c.block_size_power_of_two:
            assert bin(c.default_block_size).count("1") == 1
    assert c.block_size_problem(c.default_block_size) is None
    assert isinstance(c.block_size_rule(), str) and c.block_size_rule()

    assert c.dtypes and set(c.dtypes) <= KNOWN_DTYPES, c.dtypes
    assert c.default_dtype in c.dtypes
    assert isinstance(c.default_cache_max_entry_count, float) and 0 < c.default_cache_max_entry_count <= 1
    assert sorted(c.kv_axis_order) == sorted("bshd")


@pytest.mark.parametrize("name", sorted(DOCS_TABLE))
def test_in_tree_capabilities_match_design(name):
    want = DOCS_TABLE[name]
    cls = registry.load_backend_class(name)
    c = cls.capabilities
    assert cls.__module__ == f"lmport.backends.{name}"
    assert registry.backend_origin(name) == "lmport"
    assert set(c.kv_quant_policies) == want["quant"]
    assert c.torch_device == want["torch_device"]
    assert c.dist_backend == want["dist"]
    kind, size = want["rule"]
    if kind == "forced":
        assert c.block_size_forced == size
    elif kind == "pow2":
        assert (c.block_size_forced, c.block_size_power_of_two, c.block_size_min) == (None, True, size)
    else:
        assert (c.block_size_forced, c.block_size_power_of_two, c.block_size_min) == (None, False, size)
    if "default_block_size" in want:
        assert c.default_block_size == want["default_block_size"]
    if name != "cpu":  # cpu is the fallback of device_type="auto"
        assert c.priority > registry.load_backend_class("cpu").capabilities.priority


def test_probe_returns_a_result(backend_name, backend_class):
    result = backend_class.probe()  # the backend's own probe, not the registry's safety net
    assert isinstance(result, ProbeResult)
    assert isinstance(result.available, bool)
    assert isinstance(result.reason, str) and result.reason.strip()
    assert registry.safe_probe(backend_class) == result


def _broken_module(name):
    """A vendor module that imports but whose every attribute fails, as a half-installed SDK does."""
    class Broken(types.ModuleType):
        def __getattr__(self, attr):
            raise RuntimeError(f"{name}: driver/runtime version mismatch")
    return Broken(name)


def test_probe_never_raises_on_a_broken_vendor_stack(backend_class, monkeypatch):
    for sdk in BROKEN_SDKS:
        monkeypatch.setitem(sys.modules, sdk, _broken_module(sdk))

    def cuda_fails():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", cuda_fails)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = backend_class.probe()
    assert isinstance(result, ProbeResult) and isinstance(result.available, bool) and result.reason
    if backend_class.capabilities.device_type in ("cuda", "ascend", "camb"):
        assert result.available is False, result


RAISING_PLUGIN = """
from lmport.platform.backend import Backend, Capabilities, ProbeResult

def caps(name):
    return Capabilities(device_type=name, torch_device="cpu", kv_quant_policies=frozenset({0}),
                        default_block_size=16, dist_backend="gloo", priority=10_000)

class RaisingBackend(Backend):
    capabilities = caps("raising")

    @classmethod
    def probe(cls):
        raise RuntimeError("vendor driver exploded")

class NotAResultBackend(Backend):
    capabilities = caps("notaresult")

    @classmethod
    def probe(cls):
        return True
"""


def test_safe_probe_reports_a_probe_that_raises(install_fake_plugin, freeze_discovery, caplog, capsys):
    install_fake_plugin("lmport-raising-device",
                        {"raising": "fake_raising_plugin:RaisingBackend",
                         "notaresult": "fake_raising_plugin:NotAResultBackend"},
                        {"fake_raising_plugin": RAISING_PLUGIN})
    assert {"raising", "notaresult"} <= set(registry.backend_names())
    freeze_discovery()

    raising = registry.load_backend_class("raising")
    with pytest.raises(RuntimeError):
        raising.probe()
    result = registry.safe_probe(raising)
    assert result.available is False
    assert "RuntimeError" in result.reason and "vendor driver exploded" in result.reason
    odd = registry.safe_probe(registry.load_backend_class("notaresult"))
    assert odd.available is False and "True" in odd.reason

    reports = {r.name: r for r in registry.describe_backends()}
    assert reports["raising"].capabilities is not None
    assert reports["raising"].probe == result
    assert reports["raising"].origin == "lmport-raising-device"

    # device_type="auto" passes over it, priority 10000 notwithstanding, and says why.
    with caplog.at_level(logging.INFO, logger="lmport.platform.registry"):
        chosen = registry.select_auto()
    assert chosen.capabilities.device_type not in ("raising", "notaresult")
    assert "passing over raising" in caplog.text and "vendor driver exploded" in caplog.text

    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^raising\s+no\s", out, re.M), out
    assert re.search(r"^\s+raising: probe raised RuntimeError: vendor driver exploded$", out, re.M), out
