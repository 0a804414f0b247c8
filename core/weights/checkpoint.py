"""A checkpoint's weight format, read from its metadata alone, and the check against a backend.

Runs before any tensor loads (the engine and ``lmport plan`` both call it), so a backend that
cannot run the format is refused with a ConfigError naming the backends that can.
"""
from __future__ import annotations

from pathlib import Path

from lmport.config import ConfigError


def checkpoint_formats(path: Path) -> set[tuple[int, int]]:
    """(bits, group size) of the checkpoint's quantized weights as lmport keeps them; empty: a float checkpoint."""
    if path.suffix == ".gguf":
        from lmport.weights import gguf
        return gguf.weight_formats(path)
    from lmport.weights import packed_int
    return packed_int.weight_formats(path)


def check_backend(path: Path, caps, weight_format: str = "auto") -> set[tuple[int, int]]:
    """The formats to keep quantized (empty when dequantizing); ConfigError when ``caps`` runs none of them."""
    formats = checkpoint_formats(path) if weight_format == "auto" else set()
    for bits, group in sorted(formats):
        problem = caps.weight_format_problem(bits, group)
        if problem:
            raise ConfigError(
                f"{path.name} keeps int{bits} weights in groups of {group}, which device {caps.device_type!r} "
                f"cannot run ({problem}); backends that run it: "
                f"{', '.join(backends_running(bits, group)) or 'none installed'}. "
                f"Use one of those, a 16-bit checkpoint, or weight_format='dequantize' to dequantize at load")
    return formats


def backends_running(bits: int, group: int) -> list[str]:
    from lmport import registry
    return [r.name for r in registry.describe_backends()
            if r.capabilities and r.capabilities.weight_format_problem(bits, group) is None]
