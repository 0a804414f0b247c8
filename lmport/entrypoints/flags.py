"""EngineConfig and GenerationConfig fields as command-line flags, and the parsed flags back as configs.

The flags are generated from the dataclasses so they never drift: ``--quant-policy``,
``--max-new-tokens``, ... Every subcommand's module imports these from here, never from
``lmport.entrypoints.cli``, so the CLI can import the subcommands without an import cycle.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from lmport.config import EngineConfig, GenerationConfig

ALIASES = {"device_type": ["--device"]}
SKIP = {"adjustments", "resolved_backend"}


def _number(text: str) -> float | int:
    """cache_max_entry_count: "0.5" is a share of free memory, "100" an exact block count."""
    return float(text) if any(c in text for c in ".eE") else int(text)


def _quant_policy(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, title: str) -> None:
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
        elif hint.startswith("dict"):   # response_format: a JSON object on the command line
            kwargs["type"] = json.loads
        elif f.name == "cache_max_entry_count":
            kwargs["type"] = _number
        elif f.name == "quant_policy":   # 0, 8, 4, or fp8 (a name)
            kwargs["type"] = _quant_policy
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
