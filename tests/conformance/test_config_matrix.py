"""EngineConfig against every installed backend: acceptance, rejection and adjustment.

Expectations come from this file's own reading of the block-size rule (a tiny
table per rule kind), not from ``Capabilities.block_size_problem``.
"""
from __future__ import annotations

import ast
import dataclasses
import logging
import math
from pathlib import Path

import pytest

import lmport
from lmport import Adjustment, ConfigError, EngineConfig
from lmport.platform import registry
from lmport.platform.resolution import resolve_config

ROOT = Path(__file__).resolve().parents[2]
QUANT_POLICIES = (0, 4, 8)
BLOCK_SIZES = (None, 1, 16, 32, 64, 100, 128)

# The block sizes among BLOCK_SIZES each rule kind accepts (None = the default: always).
RULE_TABLE = {
    "any >= 1": {None, 1, 16, 32, 64, 100, 128},
    "power of two >= 16": {None, 16, 32, 64, 128},
    "forced": {None, 1, 16, 32, 64, 100, 128},  # accepted, then replaced by the forced size
}
# The in-tree backends' rule kinds, as docs/backends.md states them.
DOCS_RULES = {"cpu": "any >= 1", "cuda": "power of two >= 16", "ascend": "power of two >= 16", "camb": "forced"}


def rule_kind(caps) -> str:
    if caps.block_size_forced is not None:
        return "forced"
    if caps.block_size_power_of_two:
        return f"power of two >= {caps.block_size_min}"
    return f"any >= {caps.block_size_min}"


def block_size_accepted(caps, block_size) -> bool:
    kind = rule_kind(caps)
    if kind in RULE_TABLE:
        return block_size in RULE_TABLE[kind]
    # A plugin with a minimum this table does not list: the same rule, by arithmetic.
    if block_size is None:
        return True
    power_of_two = block_size > 0 and (block_size & (block_size - 1)) == 0
    return block_size >= caps.block_size_min and (power_of_two or not caps.block_size_power_of_two)


def block_size_used(caps, block_size) -> int:
    if caps.block_size_forced is not None:
        return caps.block_size_forced
    return caps.default_block_size if block_size is None else block_size


@pytest.fixture(scope="module", autouse=True)
def _discover_once():
    """Scan the entry points once for this module.

    ``importlib.metadata.entry_points()`` reads every installed distribution
    (~20 ms), and one config construction looks a backend up several times;
    discovery itself is tested in tests/test_registry.py. Loading still goes
    through stevedore for real.
    """
    found = registry._entry_points()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_entry_points", lambda: found)
        yield


def devices_supporting(policy: int) -> list[str]:
    names = []
    for name in registry.backend_names():
        try:
            caps = registry.load_backend_class(name).capabilities
        except registry.BackendError:
            continue
        if policy in caps.kv_quant_policies:
            names.append(name)
    return names


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"block{b}")
@pytest.mark.parametrize("quant_policy", QUANT_POLICIES, ids=lambda q: f"quant{q}")
def test_config_matrix(backend_name, capabilities, quant_policy, block_size, caplog):
    caps = capabilities
    if backend_name in DOCS_RULES:
        assert rule_kind(caps) == DOCS_RULES[backend_name]
    quant_ok = quant_policy in caps.kv_quant_policies
    block_ok = block_size_accepted(caps, block_size)

    if not (quant_ok and block_ok):
        with pytest.raises(ConfigError) as info:
            resolve_config(EngineConfig(device_type=backend_name, quant_policy=quant_policy, block_size=block_size))
        message = str(info.value)
        assert repr(backend_name) in message or f" {backend_name}" in message, message
        if not quant_ok and block_ok:
            assert f"quant_policy={quant_policy}" in message, message
            for other in devices_supporting(quant_policy):
                assert other in message, f"{other} supports quant_policy={quant_policy}: {message}"
            assert "use quant_policy=0" in message, message
        elif quant_ok and not block_ok:
            assert f"block_size={block_size}" in message, message
            assert str(caps.default_block_size) in message, message
        return

    cfg = EngineConfig(device_type=backend_name, quant_policy=quant_policy, block_size=block_size)
    before = dataclasses.asdict(cfg)
    with caplog.at_level(logging.WARNING, logger="lmport.platform.resolution"):
        resolved = resolve_config(cfg)
    assert dataclasses.asdict(cfg) == before, "resolve() changed the user's config"
    assert cfg.block_size == block_size and cfg.adjustments == ()
    assert resolved is not cfg
    assert resolved.device_type == backend_name
    assert resolved.quant_policy == quant_policy
    assert resolved.block_size == block_size_used(caps, block_size)
    assert resolved.dtype in caps.dtypes
    assert 0 < resolved.cache_max_entry_count <= 1

    if block_size is not None and resolved.block_size != block_size:
        assert len(resolved.adjustments) == 1, resolved.adjustments
        adj = resolved.adjustments[0]
        assert isinstance(adj, Adjustment)
        assert (adj.field, adj.asked, adj.used) == ("block_size", block_size, caps.block_size_forced)
        assert backend_name in adj.reason
        logged = [r for r in caplog.records if r.name == "lmport.platform.resolution"]
        assert len(logged) == 1 and "block_size" in logged[0].getMessage(), caplog.text
    else:
        assert resolved.adjustments == ()
        assert not [r for r in caplog.records if r.name == "lmport.platform.resolution"], caplog.text
    # Resolution runs once: the resolved config passes through unchanged.
    assert resolve_config(resolved) is resolved


def test_camb_quant8_names_device_supported_devices_and_fix():
    with pytest.raises(ConfigError) as info:
        resolve_config(EngineConfig(device_type="camb", quant_policy=8))
    message = str(info.value)
    assert "quant_policy=8" in message and "camb" in message
    for name in ("cuda", "ascend", "cpu"):
        assert name in message, message
    assert "use quant_policy=0" in message


def test_kv_cache_dtype_resolves_where_the_backend_keeps_it():
    """cpu keeps a float32 model's K/V in float16 too; "auto" and the model's own dtype resolve everywhere;
    another dtype elsewhere, or beside KV quantization, is refused with the fix named."""
    assert resolve_config(EngineConfig(device_type="cpu", kv_cache_dtype="float16")).kv_cache_dtype == "float16"
    assert resolve_config(EngineConfig(device_type="cpu")).kv_cache_dtype == "float32"
    assert resolve_config(EngineConfig(device_type="camb", dtype="bfloat16")).kv_cache_dtype == "bfloat16"
    assert resolve_config(EngineConfig(device_type="camb", kv_cache_dtype="float16")).kv_cache_dtype == "float16"
    with pytest.raises(ConfigError) as info:
        resolve_config(EngineConfig(device_type="camb", dtype="bfloat16", kv_cache_dtype="float16"))
    message = str(info.value)
    assert "kv_cache_dtype='float16'" in message and "camb" in message and "cpu" in message, message
    assert "use kv_cache_dtype='auto'" in message
    with pytest.raises(ConfigError, match="quant_policy=8: a quantized cache keeps codes"):
        resolve_config(EngineConfig(device_type="cpu", quant_policy=8, kv_cache_dtype="float16"))
    resolved = resolve_config(EngineConfig(device_type="cpu", quant_policy=8))
    assert resolve_config(dataclasses.replace(resolved, resolved_backend=None)).quant_policy == 8


def test_camb_block_size_64_is_adjusted_to_16():
    cfg = EngineConfig(device_type="camb", block_size=64)
    resolved = resolve_config(cfg)
    assert resolved.block_size == 16
    assert len(resolved.adjustments) == 1
    adj = resolved.adjustments[0]
    assert (adj.field, adj.asked, adj.used) == ("block_size", 64, 16)
    assert adj.reason
    assert cfg.block_size == 64 and cfg.adjustments == ()
    assert resolve_config(EngineConfig(device_type="camb", block_size=64)).block_size == 16


def test_resolve_rechecks_a_config_mutated_after_construction():
    cfg = EngineConfig(device_type="camb")
    cfg.quant_policy = 8
    with pytest.raises(ConfigError, match="quant_policy=8"):
        resolve_config(cfg)


def test_constructing_a_config_loads_no_backend(monkeypatch):
    """An EngineConfig is a plain value: only resolve_config reads the installed backends."""
    def refuse(*_):
        raise AssertionError("an EngineConfig constructor loaded a backend")
    monkeypatch.setattr(registry, "load_backend_class", refuse)
    monkeypatch.setattr(registry, "_entry_points", refuse)
    cfg = EngineConfig(device_type="camb", quant_policy=8, block_size=48)
    assert cfg.resolved_backend is None
    with pytest.raises(ConfigError, match="not resolved"):
        cfg.backend_class()


def test_unknown_device_type_lists_installed_backends():
    with pytest.raises(ConfigError) as info:
        resolve_config(EngineConfig(device_type="tpu"))
    message = str(info.value)
    assert "tpu" in message
    for name in registry.backend_names():
        assert name in message, message


def test_auto_resolves_to_the_best_available_backend():
    available = {}
    for name in registry.backend_names():
        try:
            cls = registry.load_backend_class(name)
        except registry.BackendError:
            continue
        if registry.safe_probe(cls).available:
            available[name] = cls.capabilities.priority
    expected = max(available, key=available.get)
    if not any(available.get(name) for name in ("cuda", "ascend", "camb")):
        assert expected == "cpu"  # no accelerator here
    cfg = EngineConfig()
    assert cfg.device_type == "auto"
    resolved = resolve_config(cfg)
    assert resolved.device_type == expected
    assert cfg.device_type == "auto"


BAD_FIELDS = [
    ("cache_max_entry_count", 0), ("cache_max_entry_count", -1), ("cache_max_entry_count", 1.5),
    ("cache_max_entry_count", True), ("cache_max_entry_count", "x"), ("cache_max_entry_count", 0.0),
    ("cache_max_entry_count", math.nan), ("cache_max_entry_count", math.inf),
    ("quant_policy", 3), ("quant_policy", 1), ("quant_policy", True), ("quant_policy", 8.0),
    ("quant_policy", "8"), ("quant_policy", None),
    ("max_batch_size", 0), ("max_batch_size", -1), ("max_batch_size", 2.5), ("max_batch_size", True),
    ("max_prefill_token_num", 0), ("max_prefill_token_num", "4096"),
    ("session_len", 0), ("session_len", -5), ("session_len", "long"),
    ("tp", 0), ("tp", 1.0),
    ("dtype", "int3"), ("dtype", None), ("dtype", ""),
    ("kv_cache_dtype", "fp8_e5m2"), ("kv_cache_dtype", None), ("kv_cache_dtype", "int8"),
    ("quant_policy", "fp8_e5m2"), ("quant_policy", "int8"),
    ("block_size", 0), ("block_size", -16), ("block_size", 16.0), ("block_size", True), ("block_size", "16"),
    ("host_cache_gib", -1), ("host_cache_gib", "2"), ("host_cache_gib", True),
    ("enable_prefix_caching", "yes"), ("enable_prefix_caching", 1),
    ("device_type", ""), ("device_type", None), ("device_type", 3),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_field_check_raises_config_error(field, value):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})
    assert isinstance(info.value, ValueError)
    assert field in str(info.value), str(info.value)
    assert lmport.ConfigError is ConfigError


GOOD_FIELDS = [
    ("cache_max_entry_count", 1.0), ("cache_max_entry_count", 0.5), ("cache_max_entry_count", 1),
    ("cache_max_entry_count", 4096), ("cache_max_entry_count", None), ("session_len", None),
    ("host_cache_gib", 0), ("host_cache_gib", 2.5), ("dtype", "bfloat16"), ("enable_prefix_caching", True),
    ("kv_cache_dtype", "float16"), ("kv_cache_dtype", "auto"),
]


@pytest.mark.parametrize("field,value", GOOD_FIELDS, ids=[f"{f}={v!r}" for f, v in GOOD_FIELDS])
def test_field_check_accepts_valid_values(field, value):
    assert getattr(EngineConfig(**{field: value}), field) == value


def test_no_assert_used_for_validation():
    """Validation raises real exceptions: no ``assert`` statement in lmport/ (python -O strips them)."""
    found = []
    for folder in ("lmport",):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Assert)]
    assert not found, f"assert statements (use ConfigError or another real exception): {found}"
