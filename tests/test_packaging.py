"""Packaging: entry points, every package folder installed, the console script."""
from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import warnings
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_TREE = {"ascend", "camb", "cpu", "cuda"}


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # pyright: ignore[reportMissingImports] - Python 3.10 only
        except ImportError:
            from pip._vendor import tomli as tomllib
    with path.open("rb") as f:
        return tomllib.load(f)


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return _load_toml(ROOT / "pyproject.toml")


def test_must_show_entry_points_command():
    """The issue's command, verbatim."""
    command = ("import importlib.metadata as m; "
               "print(sorted(e.name for e in m.entry_points(group='lmport.backends')))")
    proc = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, timeout=60,
                          cwd=str(ROOT.parent))
    assert proc.returncode == 0, proc.stderr
    names = set(ast.literal_eval(proc.stdout.strip()))
    assert IN_TREE <= names, proc.stdout


def test_installed_entry_points_match_pyproject(pyproject):
    declared = pyproject["project"]["entry-points"]["lmport.backends"]
    assert IN_TREE <= set(declared)
    for name, value in declared.items():
        assert value.startswith(f"lmport.backends.{name}:"), (name, value)
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="lmport.backends")
                 if ep.dist is not None and ep.dist.name == "lmport"}
    assert installed == declared, ("the installed lmport's entry points differ from pyproject.toml; "
                                   "run `make setup` to reinstall")


def test_console_script(pyproject):
    assert pyproject["project"]["scripts"]["lmport"] == "lmport.entrypoints.cli:main"
    script = Path(sys.executable).parent / "lmport"
    assert script.exists(), f"no `lmport` console script next to {sys.executable}; run `make setup`"


@pytest.mark.parametrize("name", sorted(IN_TREE))
def test_import_in_tree_backend(name):
    module = importlib.import_module(f"lmport.backends.{name}")
    assert Path(module.__file__).parts[-2:] == (name, "__init__.py")


def _package_folders() -> dict[str, Path]:
    """Every folder under lmport/ with an __init__.py, by the package name it installs as (its path)."""
    return {".".join(init.parent.relative_to(ROOT).parts): init.parent
            for init in sorted((ROOT / "lmport").rglob("__init__.py")) if "__pycache__" not in init.parts}


def test_every_package_folder_is_found(pyproject):
    """The folders are the packages: setuptools' find with pyproject's include installs each one, no other."""
    from setuptools import find_packages
    found = set(find_packages(str(ROOT), **pyproject["tool"]["setuptools"]["packages"]["find"]))
    assert found == set(_package_folders())


def test_no_python_folder_without_init():
    """A folder of modules without __init__.py is a namespace package that `packages` silently skips."""
    orphans = []
    for path in (ROOT / "lmport").rglob("*.py"):
        parent = path.parent
        if "__pycache__" not in parent.parts and not (parent / "__init__.py").exists():
            orphans.append(str(parent.relative_to(ROOT)))
    assert not orphans, f"folders with modules but no __init__.py: {sorted(set(orphans))}"


def _copy_sources(tmp_path: Path) -> Path:
    """What a wheel is built from, copied, so that no build/ or egg-info lands in the working tree."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "lmport", src / "lmport", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    return src


def _check_wheel(names: set[str], entry_points: str) -> None:
    """``names``: the wheel's files; ``entry_points``: its entry_points.txt."""
    assert "lmport/backends/cuda/__init__.py" in names
    csrc = ROOT / "lmport" / "backends" / "cpu" / "csrc"   # the cpu kernels build from every file of it at run time
    for path in csrc.rglob("*"):
        if path.is_file():
            assert path.relative_to(ROOT).as_posix() in names, path
    for package in _package_folders():
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    for name in IN_TREE:
        assert f"{name} = lmport.backends.{name}:" in entry_points


def test_the_wheels_files_as_setuptools_lists_them(tmp_path, monkeypatch):
    """The wheel's contract without building one: setuptools' build_py lists the files it would copy and
    egg_info writes the entry points, from pyproject.toml (test_wheel_contains_every_package builds the wheel)."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    monkeypatch.chdir(_copy_sources(tmp_path))   # setuptools reads the package-dir paths relative to here
    dist = Distribution()
    dist.script_name = "setup.py"   # build_py asks for a setup script's name; none exists or runs
    apply_configuration(dist, "pyproject.toml")
    build_py = dist.get_command_obj("build_py")
    build_py.ensure_finalized()
    with warnings.catch_warnings():   # csrc/ is package data, which setuptools warns could be a package
        warnings.simplefilter("ignore")
        outputs = build_py.get_outputs(include_bytecode=False)   # runs egg_info, as a wheel build does
    names = {Path(p).relative_to(build_py.build_lib).as_posix() for p in outputs}
    entry_points = Path(dist.get_command_obj("egg_info").egg_info, "entry_points.txt").read_text()
    _check_wheel(names, entry_points)


@pytest.mark.slow
def test_wheel_contains_every_package(tmp_path):
    src = _copy_sources(tmp_path)
    out = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = out.glob("lmport-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    _check_wheel(names, zipfile.ZipFile(wheel).read(entry_points).decode())
