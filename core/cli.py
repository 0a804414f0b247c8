"""The `lmport` command: one entry point, a subcommand per task."""
from __future__ import annotations

import argparse
import sys

from lmport import registry


def cmd_backends(args) -> int:
    rows = [("backend", "available", "quant policies", "block size", "torch device", "dist", "origin")]
    reasons = []
    for r in registry.describe_backends():
        caps = r.capabilities
        rows.append((
            r.name, "yes" if r.probe.available else "no",
            ",".join(str(p) for p in sorted(caps.kv_quant_policies)) if caps else "-",
            f"{caps.block_size_rule()} (default {caps.default_block_size})" if caps else "-",
            caps.torch_device if caps else "-", caps.dist_backend if caps else "-", r.origin))
        reasons.append(f"  {r.name}: {r.probe.reason}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\nwhy:")
    print("\n".join(reasons))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmport", description="A pluggable multi-device LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list installed backends, their capabilities and availability")
    p.set_defaults(func=cmd_backends)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
