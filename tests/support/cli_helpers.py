"""Helpers for tests of the `lmport` command and of plugin discovery: the console script, an
installed-looking fake plugin distribution, and the `lmport backends` table parsed."""
from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path


def lmport_command() -> list[str]:
    """The `lmport` console script of this interpreter's environment (``-m lmport.entrypoints.cli`` if it has none)."""
    script = Path(sys.executable).parent / ("lmport.exe" if os.name == "nt" else "lmport")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmport"]


def write_fake_distribution(site: Path, dist: str, entry_points: dict[str, str],
                            sources: dict[str, str] | None = None) -> Path:
    """Write an installed-looking distribution into ``site``: a dist-info with
    ``lmport.backends`` entry points, plus its modules. Put ``site`` on the path to install it."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[lmport.backends]\n" + "".join(f"{name} = {value}\n" for name, value in entry_points.items()))
    for module, source in (sources or {}).items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    return site


def parse_backends_table(text: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Split `lmport backends` output into ({name: {column: cell}}, {name: reason})."""
    table, _, why = text.partition("\nwhy:")
    lines = [line for line in table.splitlines() if line.strip()]
    if not lines:
        raise AssertionError(f"`lmport backends` printed no table:\n{text}")
    header = re.split(r"\s{2,}", lines[0].strip())
    rows = {}
    for line in lines[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(header):
            raise AssertionError(f"row {line!r} does not have the {len(header)} columns {header}")
        row = dict(zip(header, cells))
        rows[row[header[0]]] = row
    reasons = {}
    for line in why.splitlines():
        name, sep, reason = line.strip().partition(": ")
        if sep:
            reasons[name] = reason
    return rows, reasons
