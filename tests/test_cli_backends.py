"""`lmport backends`, run as the installed console script: one row and one reason per installed backend."""
from __future__ import annotations

from lmport.platform import registry

COLUMNS = ("backend", "available", "quant policies", "block size", "origin")


def test_header_has_the_columns(backends_output):
    header = backends_output.splitlines()[0]
    for column in COLUMNS:
        assert column in header, header


def test_one_row_per_installed_backend(backends_table):
    rows, reasons = backends_table
    assert set(rows) == set(registry.backend_names())
    assert set(reasons) == set(rows), "every backend needs a line saying why it is or is not usable"


def test_row_shows_capabilities_and_origin(backend_name, backends_table):
    name = backend_name
    rows, reasons = backends_table
    row = rows[name]
    cls = registry.load_backend_class(name)
    caps = cls.capabilities
    fp8 = ["fp8"] if caps.runs_kv_policy("fp8") else []
    assert row["quant policies"] == ",".join([str(q) for q in sorted(caps.kv_quant_policies)] + fp8)
    assert row["block size"].startswith(caps.block_size_rule())
    assert str(caps.default_block_size) in row["block size"]
    assert row["origin"] == registry.backend_origin(name)
    assert row["available"] == ("yes" if registry.safe_probe(cls).available else "no")
    assert reasons[name].strip()


def pytest_generate_tests(metafunc):
    # One case per installed backend, read at collection (as in tests/conformance/conftest.py).
    if "backend_name" in metafunc.fixturenames:
        names = registry.backend_names()
        metafunc.parametrize("backend_name", names, ids=names)


def test_in_tree_rows(backends_table):
    rows, _ = backends_table
    expected = {"cpu": ("0,4,8,fp8", "any >= 1"), "cuda": ("0,4,8,fp8", "power of two >= 16"),
                "ascend": ("0,4,8", "power of two >= 16"), "camb": ("0", "forced 16")}
    for name, (quant, rule) in expected.items():
        assert rows[name]["quant policies"] == quant
        assert rows[name]["block size"].startswith(rule)
        assert rows[name]["origin"] == "lmport"
    assert rows["cpu"]["available"] == "yes"
