#!/usr/bin/env bash
# Resolve the client suite's venvs (tests/clients/run.py, `make test-clients`) from requirements/clients/NAME.in
# into NAME.txt with hashes, and print which pins moved. Each .in pins its client libraries exactly: moving one is
# an edit there, then this script, then `make test-clients` on the result.
set -euo pipefail
cd "$(dirname "$0")/../.."
tools=build/lock-tools
test -x "$tools/bin/pip-compile" || { python3 -m venv "$tools" && "$tools/bin/pip" install -q pip-tools; }
for in in requirements/clients/*.in; do
    out=${in%.in}.txt
    before=$(mktemp) && { grep -E '^[A-Za-z0-9]' "$out" 2>/dev/null || true; } | sed 's/ .*//' > "$before"
    "$tools/bin/pip-compile" -q --upgrade --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
        --no-emit-find-links -o "$out" "$in"
    echo "$out: pins that moved (- before, + now):"
    diff "$before" <(grep -E '^[A-Za-z0-9]' "$out" | sed 's/ .*//') | grep -E '^[<>]' | sed 's/^</  -/; s/^>/  +/' \
        || echo "  none"
done
