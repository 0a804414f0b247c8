"""Run a command against one deliberate bug: replace OLD by NEW (exactly once) in FILE, run CMD, put the file back
byte for byte. docs/testing.md's mutation table is made with it; a row holds when CMD fails.

usage: python tests/support/mutate.py FILE OLD NEW -- CMD...
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    path, old, new = Path(argv[0]), argv[1], argv[2]
    command = argv[argv.index("--") + 1:]
    original = path.read_bytes()
    times = path.stat()
    text = original.decode()
    if text.count(old) != 1:
        sys.exit(f"{old!r} occurs {text.count(old)} times in {path}; a mutation must name one place")
    try:
        path.write_text(text.replace(old, new))
        code = subprocess.call(command)
    finally:
        path.write_bytes(original)
        # The original mtime back and the mutant's bytecode gone, so no later import runs the mutant.
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
        for compiled in (path.parent / "__pycache__").glob(path.stem + ".*.pyc"):
            compiled.unlink(missing_ok=True)
    print(f"mutant {'caught' if code else 'SURVIVED'}: {path}: {old.strip()!r} -> {new.strip()!r}", file=sys.stderr)
    return 0 if code else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
