"""Sizes: byte units (binary GiB/MiB, parsing and formatting them) and ceil-division into whole blocks."""
from __future__ import annotations

import re

from lmport.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up: the whole blocks of ``b`` that hold ``a``."""
    return -(-a // b)


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """"24GiB", "24G" (both 2**30 units), "24GB" (10**9), "512MiB" or a plain byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or not unit or float(match.group(1)) <= 0:
        raise ConfigError(f"{flag} {text!r}: give a size such as 24GiB, 80G, 512MiB or a byte count")
    return int(float(match.group(1)) * unit)
