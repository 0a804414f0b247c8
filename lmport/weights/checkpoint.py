"""A checkpoint's weight formats, read from its metadata alone, and the check against a backend.

Runs before any tensor loads (the engine and ``lmport plan`` both call it), so a backend that
cannot run a format is refused with a ConfigError naming the backends that can.
"""
from __future__ import annotations

from pathlib import Path

from lmport.config import ConfigError
from lmport.weights import fp8, packed_int
from lmport.weights.format import check_quantized_tp
from lmport.weights.ggml import REFERENCE_BLOCK_TYPES


def checkpoint_formats(path: Path) -> tuple[set[tuple[int, int]], set[str]]:
    """The checkpoint's quantized weights as lmport keeps them: (bits, group size) of the int formats, and
    the GGUF block types kept as they are. Both empty: a float checkpoint. A GGUF of an architecture
    lmport does not run, or with a tensor type it has no kernel form for, is a ConfigError."""
    if path.suffix == ".gguf":
        from lmport.weights import gguf
        gguf.architecture(path)
        formats, blocks, other = gguf.tensor_formats(path)
        if other:
            listed = ", ".join(f"{name} ({kind})" for name, kind in list(other.items())[:4])
            raise ConfigError(f"{path.name} holds tensors of types lmport does not run quantized: {listed}"
                              f"{' ...' if len(other) > 4 else ''}; use weight_format='dequantize' to load them "
                              f"float, or a file quantized to Q4_0, Q4_1, Q8_0 or {', '.join(_block_names())}")
        return formats, blocks
    return packed_int.weight_formats(path), set()


def is_quantized(path: Path) -> bool:
    return any(checkpoint_formats(path))


def check_backend(path: Path, caps, weight_format: str = "auto") -> bool:
    """Whether the weights stay quantized (False when dequantizing at load); ConfigError when ``caps``
    cannot run one of the checkpoint's formats."""
    fp8_checkpoint = fp8.read_checkpoint(path) if path.is_dir() else None   # an fp8 scheme it cannot load: refused
    if weight_format != "auto":
        if path.suffix == ".gguf":
            from lmport.weights import gguf
            gguf.architecture(path)
        return False
    if fp8_checkpoint is not None:
        fp8.check_backend(fp8_checkpoint, path, caps, backends_running)
        return True
    formats, blocks = checkpoint_formats(path)
    fix = "Use one of those, a 16-bit checkpoint, or weight_format='dequantize' to dequantize at load"
    for bits, group in sorted(formats):
        problem = caps.weight_format_problem(bits, group)
        if problem:
            raise ConfigError(
                f"{path.name} keeps int{bits} weights in groups of {group}, which device {caps.device_type!r} "
                f"cannot run ({problem}); backends that run it: "
                f"{', '.join(backends_running(lambda c, b=bits, g=group: c.weight_format_problem(b, g) is None))}. "
                f"{fix}")
    missing = sorted(blocks - caps.ggml_types - REFERENCE_BLOCK_TYPES.keys())   # those run on the reference op
    if missing:
        raise ConfigError(
            f"{path.name} holds GGUF {', '.join(missing)} blocks, which device {caps.device_type!r} cannot run "
            f"(it runs {', '.join(sorted(caps.ggml_types)) or 'no GGUF block types'}); backends that run them: "
            f"{', '.join(backends_running(lambda c: set(missing) <= c.ggml_types))}. {fix}")
    return bool(formats or blocks)


def check_tensor_parallel(path: Path, tp: int, weight_format: str) -> None:
    """ConfigError, before any weight loads, for a checkpoint whose weights would stay quantized under ``tp > 1``
    (lmport.weights.format.check_quantized_tp). An AWQ / GPTQ directory's packed weights are refused whatever
    ``weight_format`` says; a GGUF's dequantize at load with weight_format='dequantize'. A mixture-of-experts
    GGUF's quantized experts split by their intermediate dimension (in whole blocks: gguf.check_expert_split),
    its other tensors loading in the compute dtype; so do an fp8 mixture of experts' experts (in their scale
    blocks)."""
    if tp == 1:
        return
    if path.is_dir() and fp8.read_checkpoint(path) is not None and fp8.routed_experts(path):
        return   # its experts split in their scale blocks (lmport.parallel.check_tp), the rest loads float
    packed = path.is_dir() and packed_int.quantization_config(path) is not None
    if path.suffix == ".gguf" and weight_format == "auto" and is_quantized(path):
        from lmport.weights import gguf
        if gguf.quantized_stacked_experts(path):
            gguf.check_expert_split(path, tp)
            return
    quantized = packed or (weight_format == "auto" and is_quantized(path))
    check_quantized_tp(tp, path.name, quantized, can_dequantize=not packed)


def backends_running(runs) -> list[str]:
    """Names of the installed backends whose capabilities satisfy ``runs`` ('none installed' if none)."""
    from lmport.platform import registry
    names = [r.name for r in registry.describe_backends() if r.capabilities and runs(r.capabilities)]
    return names or ["none installed"]


def _block_names() -> list[str]:
    from lmport.weights.ggml import BLOCK_TYPES
    return [t.upper() for t in BLOCK_TYPES]
