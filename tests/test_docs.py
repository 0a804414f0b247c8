"""The docs cite files by repository path, and every one exists."""
from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = ("lmport", "tests", "benchmarks", "tools", "plugins", "docs", "requirements")
# A backticked path that starts at one of the repository's folders.
CITED = re.compile(r"`((?:" + "|".join(TOP) + r")/[A-Za-z0-9_./-]*)`")
# Paths a doc names that are not files of this repository, and why.
NOT_IN_REPO = {
    "docs/context/": "a folder of Ascend's op-plugin repository",
    "plugins/your-plugin": "the reader's own plugin",
}
# Git-ignored folders the scripts write: the benchmarks' and tools' results, the GPU kit's wheels (tools/gpu/wheels.py).
WRITTEN_BY_SCRIPTS = ("benchmarks/results/", "tools/results/", "tools/gpu/carry")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs/reports").glob("*.md"))]


def _cited(text: str) -> list[str]:
    return [m.group(1) for m in CITED.finditer(text)]


def test_docs_cite_repository_paths_that_exist():
    missing = []
    for doc in _docs():
        for path in _cited(doc.read_text()):
            name = f"{doc.relative_to(ROOT)}: {path}"
            if path not in NOT_IN_REPO and not path.startswith(WRITTEN_BY_SCRIPTS) and not (ROOT / path).exists():
                missing.append(name)
    assert not missing, f"cited paths that do not exist: {missing}"


def test_code_cites_docs_that_exist():
    """Comments and messages point readers at docs/*.md pages; each must be there."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    missing = sorted({f"{f}: {page}" for f in files if (ROOT / f).exists()   # a file deleted but not yet committed
                      for page in re.findall(r"docs/[A-Za-z0-9_-]+\.md", (ROOT / f).read_text())
                      if not (ROOT / page).exists()})
    assert not missing, missing


def test_the_check_finds_a_wrong_path():
    assert _cited("see `lmport/engine.py` and `lmport/nowhere.py`, not `torch/nn.py`") == \
        ["lmport/engine.py", "lmport/nowhere.py"]


def test_readme_links_the_architecture():
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()


# A markdown link to another page of the repository: [text](path.md) or [text](path.md#anchor).
LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)\s]*)?\)")


def test_links_between_pages_resolve():
    broken = [f"{doc.relative_to(ROOT)}: {target}" for doc in _docs()
              for target in LINK.findall(doc.read_text()) if not (doc.parent / target).exists()]
    assert not broken, f"links to files that do not exist: {broken}"


# A command line in a code block: what reproduces a report's figures.
COMMAND = re.compile(r"^(?:    )?(?:[A-Z_]+=\S+ )*(?:\.venv/bin/python|python3?|make|lmport|\.ci/run)\b", re.M)


def test_every_report_is_dated_and_names_its_command():
    reports = sorted((ROOT / "docs/reports").glob("*.md"))
    assert reports
    for report in reports:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+\.md", report.name), report.name
        assert COMMAND.search(report.read_text()), f"{report.name}: no command that reproduces it"


def _readme_blocks(language: str) -> list[str]:
    """The README's fenced code blocks whose info string is ``language`` ("" for plain blocks)."""
    blocks, info, lines = [], None, []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```") and info is None:
            info, lines = line[3:].strip(), []
        elif line.startswith("```"):
            if info == language:
                blocks.append("\n".join(lines) + "\n")
            info = None
        elif info is not None:
            lines.append(line)
    return blocks


def test_readmes_command_lines_parse():
    """Each `lmport ...` line of the README is accepted by the CLI's parser; each `make X` is a Makefile target."""
    from lmport.entrypoints.cli import build_parser
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    lines = [line.split(" #")[0].strip() for block in _readme_blocks("") for line in block.splitlines()]
    commands = [shlex.split(line) for line in lines if line]
    assert commands
    for words in commands:
        if words[0] == "make":
            assert words[1] in targets, words
        else:
            assert words[0] == "lmport", words
            try:
                build_parser().parse_args(words[1:])
            except SystemExit:   # argparse's answer to a command or flag it does not know
                pytest.fail(f"the README's `{' '.join(words)}` is not a command lmport takes")


def test_readmes_python_runs(tmp_path):
    """The README's Python blocks run as written (the default model, on the best available backend)."""
    blocks = _readme_blocks("python")
    assert blocks
    for code in blocks:
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]


# Dotted names a page gives that are not Python objects, and why.
NOT_PYTHON = {"lmport.access": "the access log's logger"}


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module of lmport, or an attribute chain inside one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_docs_name_python_objects_that_exist():
    """`lmport.x.y` in a page (reports excepted: they keep the names of their day) is a module or an object."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = sorted({f"{page.relative_to(ROOT)}: {name}" for page in pages
                      for name in re.findall(r"`(lmport(?:\.[A-Za-z_]\w*)+)`", page.read_text())
                      if name not in NOT_PYTHON and not _resolves(name)})
    assert not missing, f"names that are not modules or objects of lmport: {missing}"


def test_the_name_check_finds_a_wrong_name():
    assert _resolves("lmport.config.EngineConfig") and not _resolves("lmport.config.NoSuchThing")

