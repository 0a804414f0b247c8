"""The package's import graph has no cycle (docs/architecture.md): walked from the source, imports inside
functions included, since a lazy import that closes a circle is still a circle in the design. Imports under
``if TYPE_CHECKING:`` are left out: they are annotations, never run."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"lmport": ROOT / "lmport"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path], lazy: bool = True) -> set[str]:
    """lmport modules ``name`` imports; ``from pkg import mod`` counts as importing ``pkg.mod``. ``lazy``: with
    the imports inside functions (else only those that importing ``name`` runs)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}
    if not lazy:
        typing_only |= {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for stmt in f.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:   # an attribute of a module: the module itself
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph(lazy: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    # A package's __init__ re-exporting its submodules is not a cycle with them: drop package -> child edges.
    return {name: {t for t in _imports(name, path, modules, lazy) if not t.startswith(name + ".")}
            for name, path in modules.items()}


def test_import_graph_has_no_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (modules that import each other, directly or around a circle): " + \
        "; ".join(" <-> ".join(c) for c in cycles)


def test_the_walk_sees_imports():
    graph = _graph()
    assert "lmport.entrypoints.flags" in graph["lmport.entrypoints.cli"]
    assert "lmport.config" in graph["lmport.entrypoints.flags"]
    assert "lmport.entrypoints.cli" not in graph["lmport.entrypoints.flags"]
    assert "lmport.memory.oom_advisor" in graph["lmport.memory.budget"]
    assert "lmport.memory.budget" not in graph["lmport.memory.oom_advisor"]   # only under TYPE_CHECKING
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Heavy modules an engine serving plain text never needs: transformers.activations pulls in its hub-kernel
# registry with torch's dynamo and distributed-tensor modules (seconds and about 170 MB); xgrammar is for
# requests with a response format, imported by the first one.
NOT_ON_IMPORT = ("xgrammar", "transformers.activations", "torch._dynamo", "torch.distributed.tensor")


def test_the_engine_and_server_leave_heavy_modules_out():
    import subprocess
    import sys
    code = ("import sys, lmport.engine.engine, lmport.server.app\n"
            # what a request without a format meets
            "from lmport.structured_output.grammar import Grammars, MaskBuilder\n"
            "assert Grammars(None, 8, []).matcher(None) is None and MaskBuilder(8).start([None]) is None\n"
            f"print(' '.join(m for m in {NOT_ON_IMPORT!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [], f"the engine and the server app import {out.stdout.strip()}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_walk_sees_imports_inside_functions(tmp_path):
    assert "lmport.platform.resolution" in _graph()["lmport.entrypoints.cli"]        # imported inside cmd_worker only
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from lmport.config import ConfigError\n    return ConfigError\n")
    assert _imports("lmport.units", lazy, _modules()) == {"lmport.config"}


def test_the_config_is_a_plain_value():
    """Importing lmport.config, lazily or not, reaches neither the registry nor any backend."""
    reached = _reachable(_graph(), "lmport.config")
    assert not {m for m in reached if m.startswith("lmport.platform")
                or m.startswith("lmport.backends")}, sorted(reached)



# The model side: what the HTTP front end must never load (it reads the engine's messages, errors and outputs).
MODEL_SIDE = ("lmport.worker", "lmport.models", "lmport.ops", "lmport.backends", "lmport.executor")


def _model_side(modules) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in MODEL_SIDE))


def test_the_server_app_imports_no_model_code():
    """Importing the HTTP app (what ``lmport serve``'s front end loads before it starts the engine core) reaches
    none of the model side, walked from the source: a package's __init__ counts as imported with any of its
    modules, as Python imports it first."""
    graph = _graph(lazy=False)
    reached = _reachable(graph, "lmport.server.app")
    reached |= {".".join(m.split(".")[:i]) for m in reached for i in range(2, m.count(".") + 1)}
    assert not _model_side(reached), f"lmport.server.app reaches {_model_side(reached)}"
    assert "lmport.engine.outputs" in reached   # the walk sees the app's imports


@pytest.fixture(scope="module")
def fresh_app_import() -> tuple[list[str], bool, str]:
    """Importing the app in a fresh interpreter: the lmport modules loaded, whether torch was, and the module that
    imported torch first."""
    import subprocess
    import sys
    code = ("import builtins, sys\n"
            "first, load = [], builtins.__import__\n"
            "def watch(name, globals=None, *args, **kwargs):\n"
            "    if name.split('.')[0] == 'torch' and 'torch' not in sys.modules and not first:\n"
            "        first.append((globals or {}).get('__name__'))\n"
            "    return load(name, globals, *args, **kwargs)\n"
            "builtins.__import__ = watch\n"
            "import lmport.server.app\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('lmport'))))\n"
            "print('torch' in sys.modules, first[0] if first else '')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    modules, torch_line = out.stdout.splitlines()[-2:]
    loaded, importer = (torch_line.split() + [""])[:2]
    return modules.split(), loaded == "True", importer


def test_the_server_app_loads_no_model_code(fresh_app_import):
    """The same, as Python runs it: importing the app in a fresh interpreter loads none of the model side."""
    loaded = fresh_app_import[0]
    assert "lmport.engine.outputs" in loaded and not _model_side(loaded), _model_side(loaded)


def test_the_server_app_loads_no_torch(fresh_app_import):
    """The HTTP app validates requests and relays them to the engine core, which does the tensor work: importing
    it in a fresh interpreter leaves torch unloaded (seconds and hundreds of MB a front end never needs). On a
    failure, the lmport module that imported torch first is named."""
    _, loaded, importer = fresh_app_import
    assert not loaded, f"importing lmport.server.app loads torch (first imported by {importer})"
