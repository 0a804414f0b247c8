"""The per-backend matrix: every test here that asks for ``backend_name`` runs once per installed backend.

The list is read from the ``lmport.backends`` entry points when pytest collects
the tests (names only, no backend module imported), so a newly installed plugin
joins the matrix without any change here.
"""
from __future__ import annotations

import pytest


def installed_backend_names() -> list[str]:
    from lmport.platform import registry
    return registry.backend_names()


def pytest_generate_tests(metafunc):
    if "backend_name" in metafunc.fixturenames:
        names = installed_backend_names()
        metafunc.parametrize("backend_name", names, ids=names)


@pytest.fixture(scope="module")
def backends():
    """``backends(name)``: (the backend, its mode) as the op tests use it (harness.op_backend), made once a module."""
    from harness import op_backend
    made = {}

    def get(name):
        if name not in made:
            made[name] = op_backend(name)
        return made[name]
    return get


@pytest.fixture
def backend_class(backend_name):
    from lmport.platform import registry
    return registry.load_backend_class(backend_name)


@pytest.fixture
def capabilities(backend_class):
    return backend_class.capabilities
