"""The docs cite files by repository path, and every one exists."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("lmport", "tests", "benchmarks", "plugins", "docs", "requirements")
# A backticked path that starts at one of the repository's folders.
CITED = re.compile(r"`((?:" + "|".join(TOP) + r")/[A-Za-z0-9_./-]*)`")
# Paths a doc names that are not files of this repository, and why.
NOT_IN_REPO = {
    "docs/context/": "a folder of Ascend's op-plugin repository",
    "plugins/your-plugin": "the reader's own plugin",
}
# Git-ignored folders the scripts write: the benchmarks' results, the GPU kit's wheels (benchmarks/gpu/wheels.py).
WRITTEN_BY_SCRIPTS = ("benchmarks/results/", "benchmarks/gpu/carry")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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
    missing = sorted({f"{f}: {page}" for f in files
                      for page in re.findall(r"docs/[A-Za-z0-9_-]+\.md", (ROOT / f).read_text())
                      if not (ROOT / page).exists()})
    assert not missing, missing


def test_the_check_finds_a_wrong_path():
    assert _cited("see `lmport/engine.py` and `lmport/nowhere.py`, not `torch/nn.py`") == \
        ["lmport/engine.py", "lmport/nowhere.py"]


def test_readme_links_the_architecture():
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
