"""The out-of-tree example plugin (plugins/lmport-example-device): installed, listed, and its rules enforced."""
from __future__ import annotations

import dataclasses
import importlib.util
from importlib import metadata
from pathlib import Path

import pytest

from lmport import ConfigError, EngineConfig

from lmport.platform import registry
from lmport.platform.backend import Backend
from lmport.platform.resolution import resolve_config

DIST = "lmport-example-device"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def example_plugin_installed():
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        pytest.fail(f"the example plugin distribution {DIST!r} is not installed in this environment; "
                    f"run `make setup` (it installs plugins/{DIST})", pytrace=False)
    names = [ep.name for ep in dist.entry_points if ep.group == registry.NAMESPACE]
    assert names == ["example"], f"{DIST} registers {names} in {registry.NAMESPACE}"


@pytest.fixture
def example():
    return registry.load_backend_class("example")


def test_registered_through_the_entry_point_group(example):
    assert "example" in registry.backend_names()
    assert registry.backend_origin("example") == DIST
    assert example.__module__ == "lmport_example_device"
    assert not example.__module__.startswith("lmport.")


def test_declares_no_kv_quantization_and_block_size_32(example):
    caps = example.capabilities
    assert caps.device_type == "example"
    assert caps.kv_quant_policies == frozenset({0})
    assert caps.block_size_forced == 32 and caps.default_block_size == 32
    assert registry.safe_probe(example).available


def test_runs_on_the_reference_ops(example):
    for op in ("fill_kv_cache", "paged_attention", "copy_blocks", "rms_norm", "apply_rotary"):
        assert getattr(example, op) is getattr(Backend, op), f"{op} is overridden"


def test_listed_by_lmport_backends(backends_table):
    rows, reasons = backends_table
    row = rows.get("example")
    assert row is not None, f"no row for the example plugin in `lmport backends`: {sorted(rows)}"
    assert row["origin"] == DIST
    assert row["quant policies"] == "0"
    assert row["block size"].startswith("forced 32")
    assert row["available"] == "yes"
    assert reasons.get("example")


@pytest.mark.parametrize("quant_policy", [4, 8])
def test_kv_quantization_is_rejected(quant_policy, freeze_discovery):
    freeze_discovery()
    with pytest.raises(ConfigError) as info:
        resolve_config(EngineConfig(device_type="example", quant_policy=quant_policy))
    message = str(info.value)
    assert f"quant_policy={quant_policy}" in message and "'example'" in message
    assert "cpu" in message, "the message names the devices that do support it"
    assert "use quant_policy=0" in message


@pytest.mark.parametrize("asked", [None, 1, 16, 32, 64, 128])
def test_block_size_rule_is_applied(asked):
    cfg = EngineConfig(device_type="example", block_size=asked)
    before = dataclasses.asdict(cfg)
    resolved = resolve_config(cfg)
    assert resolved.block_size == 32
    assert dataclasses.asdict(cfg) == before
    if asked in (None, 32):
        assert resolved.adjustments == ()
    else:
        [adj] = resolved.adjustments
        assert (adj.field, adj.asked, adj.used) == ("block_size", asked, 32)
        assert "example" in adj.reason


NEW_PLUGIN = """
from lmport.platform.backend import Backend, Capabilities

class FreshBackend(Backend):
    capabilities = Capabilities(device_type="fresh", torch_device="cpu", kv_quant_policies=frozenset({0, 8}),
                                default_block_size=16, dist_backend="gloo", priority=-20)
"""


def test_a_newly_installed_plugin_joins_the_conformance_matrix(install_fake_plugin):
    install_fake_plugin("lmport-fresh-device", {"fresh": "fake_fresh_plugin:FreshBackend"},
                        {"fake_fresh_plugin": NEW_PLUGIN})
    spec = importlib.util.spec_from_file_location("_conformance_conftest", ROOT / "tests/conformance/conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    class Metafunc:
        fixturenames = ["backend_name"]
        calls = []

        def parametrize(self, argnames, argvalues, **kwargs):
            self.calls.append((argnames, list(argvalues)))

    metafunc = Metafunc()
    conftest.pytest_generate_tests(metafunc)
    [(argnames, names)] = metafunc.calls
    assert argnames == "backend_name"
    assert {"cpu", "cuda", "ascend", "camb", "example", "fresh"} <= set(names)
