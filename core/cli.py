"""The `lmport` command: one entry point, a subcommand per task.

Every EngineConfig and GenerationConfig field is a flag (``--quant-policy``,
``--max-new-tokens``, ...), generated from the dataclasses so they never drift.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing

from lmport import registry
from lmport.config import ConfigError, EngineConfig, GenerationConfig

ALIASES = {"device_type": ["--device"]}
SKIP = {"adjustments"}


def _number(text: str) -> float | int:
    """cache_max_entry_count: "0.5" is a share of free memory, "100" an exact block count."""
    return float(text) if any(c in text for c in ".eE") else int(text)


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls, title: str) -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in SKIP:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *ALIASES.get(f.name, [])]
        hint = str(hints[f.name])
        kwargs: dict = {"dest": f"{cls.__name__}.{f.name}", "default": argparse.SUPPRESS}
        if hint != "<class 'bool'>":
            kwargs["metavar"] = f.name.upper()
        if hint == "<class 'bool'>":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "list[int]" in hint:
            kwargs.update(nargs="+", type=int)
        elif "list[str]" in hint:
            kwargs.update(nargs="+")
        elif f.name == "cache_max_entry_count":
            kwargs["type"] = _number
        elif "float" in hint:
            kwargs["type"] = float
        elif "int" in hint:
            kwargs["type"] = int
        kwargs["help"] = f"(default: {f.default})"
        group.add_argument(*flags, **kwargs)


def _collect(args, cls):
    prefix = f"{cls.__name__}."
    return cls(**{k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)})


def engine_config(args) -> EngineConfig:
    return _collect(args, EngineConfig)


def gen_config(args) -> GenerationConfig:
    return _collect(args, GenerationConfig)


def cmd_backends(args) -> int:
    rows = [("backend", "available", "quant policies", "weight formats", "block size", "torch device", "dist", "origin")]
    reasons = []
    for r in registry.describe_backends():
        caps = r.capabilities
        rows.append((
            r.name, "yes" if r.probe.available else "no",
            ",".join(str(p) for p in sorted(caps.kv_quant_policies)) if caps else "-",
            caps.weight_formats_text() if caps else "-",
            f"{caps.block_size_rule()} (default {caps.default_block_size})" if caps else "-",
            caps.torch_device if caps else "-", caps.dist_backend if caps else "-", r.origin))
        reasons.append(f"  {r.name}: {r.probe.reason}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\nwhy:")
    print("\n".join(reasons))
    return 0


def cmd_generate(args) -> int:
    import lmport
    cfg = gen_config(args)
    with lmport.pipeline(args.model, backend_config=engine_config(args)) as pipe:
        if args.raw:
            response = pipe.generate([pipe.tokenizer.encode(args.prompt)], cfg)[0]
        else:
            response = pipe(args.prompt, cfg)
    if response.error:
        print(f"error: {response.error}", file=sys.stderr)
        return 1
    print(response.text)
    print(f"[{response.input_token_len} prompt tokens, {response.generate_token_len} generated, "
          f"finish: {response.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from lmport.chat import chat
    return chat(args)


def cmd_serve(args) -> int:
    from lmport.server.app import serve
    return serve(args)


def cmd_plan(args) -> int:
    from lmport.plan import plan_command
    return plan_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmport", description="A pluggable multi-device LLM inference engine")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends, their capabilities and availability")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt")
    p.add_argument("--model", default="smollm2", help="smollm2, a local HF directory or a .gguf file")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt is plain text")
    _add_dataclass_flags(p, EngineConfig, "engine")
    _add_dataclass_flags(p, GenerationConfig, "generation")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive streaming chat, locally or with a server (--url)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--url", default=None, help="talk to a running `lmport serve` instead of loading the model")
    p.add_argument("--api-key", default=None)
    _add_dataclass_flags(p, EngineConfig, "engine")
    _add_dataclass_flags(p, GenerationConfig, "generation")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible API server")
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=23333)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or set LMPORT_API_KEY)")
    _add_dataclass_flags(p, EngineConfig, "engine")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plan", help="memory plan for a model on a backend, without loading weights")
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--device-memory", default=None, help="plan for a device of this size, e.g. 24GiB")
    p.add_argument("--json", action="store_true")
    _add_dataclass_flags(p, EngineConfig, "engine")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
