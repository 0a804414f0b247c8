"""`make test-clients`: the client-library suite (docs/testing.md, "The client-library suite").

Builds each client venv from its lock file (requirements/clients/NAME.txt, installed with --require-hashes; a venv
is rebuilt when its lock changes), starts one `lmport serve smollm2 --port 0`, runs each venv's test files against
it with pytest, and prints the table of client, feature and result. Arguments after the script go to every pytest
run (``-k stream``, ``-x``). The venvs live under $XDG_CACHE_HOME/lmport-clients (~/.cache/lmport-clients).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from clients.serve import ROOT, start_server, stop_server  # noqa: E402

HERE = Path(__file__).resolve().parent
LOCKS = ROOT / "requirements" / "clients"
OUT = ROOT / "build" / "clients"
VENVS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lmport-clients"
# Which venv runs which files: the pins of instructor and llama-index's OpenAI LLM need openai 2 (requirements/
# clients/openai2.in says why), the others run on openai 3.
SUITES = {
    "main": ["client_openai.py", "client_anthropic.py", "client_agents.py", "client_langchain.py",
             "client_litellm.py"],
    "openai2": ["client_instructor.py", "client_llama_index.py"],
}
STAMP = ".lock-sha256"


def venv_for(name: str) -> Path:
    """The venv holding exactly requirements/clients/NAME.txt, built or rebuilt when the lock changed."""
    lock = LOCKS / f"{name}.txt"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    venv = VENVS / name
    if (venv / STAMP).exists() and (venv / STAMP).read_text() == digest:
        return venv
    print(f"building {venv} from {lock.relative_to(ROOT)}", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--require-hashes", "-r", str(lock)],
                   check=True)
    (venv / STAMP).write_text(digest)
    return venv


def table(reports: list[Path]) -> list[tuple[str, str, str]]:
    """(client file, test, result) for each case in the JUnit reports."""
    rows = []
    for report in reports:
        for case in ElementTree.parse(report).iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            client = case.get("classname", "").rpartition(".")[2].removeprefix("client_")
            rows.append((client, case.get("name", ""), {"failure": "FAILED", "error": "ERROR"}.get(outcome, outcome)))
    return rows


def main(pytest_args: list[str]) -> int:
    venvs = {name: venv_for(name) for name in SUITES}
    OUT.mkdir(parents=True, exist_ok=True)
    server, url = start_server(OUT / "serve.log")
    print(f"lmport serve on {url} (log: {(OUT / 'serve.log').relative_to(ROOT)})", flush=True)
    status, reports = 0, []
    try:
        for name, files in SUITES.items():
            report = OUT / f"{name}.xml"
            report.unlink(missing_ok=True)
            command = [str(venvs[name] / "bin" / "python"), "-m", "pytest", "-c", str(HERE / "pytest.ini"),
                       f"--junitxml={report}", *(str(HERE / file) for file in files), *pytest_args]
            code = subprocess.run(command, cwd=ROOT, env=dict(os.environ, LMPORT_CLIENTS_URL=url)).returncode
            status = status or code
            if report.exists():
                reports.append(report)
    finally:
        stop_server(server)
    print("\n| client | feature | result |\n|---|---|---|")
    for row in table(reports):
        print("| " + " | ".join(row) + " |")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
