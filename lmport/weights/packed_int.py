"""AWQ and GPTQ safetensors checkpoints -> the internal format (docs/weight-quantization.md).

Both store, per quantized Linear, int32 words of packed codes, int32 words of packed zero
points, float16 scales [in / group, out], and w = scale * (q - zero):

- AWQ, GEMM packing (``quant_method: "awq"``, ``version: "gemm"``, 4-bit): ``qweight`` [in, out / 8],
  word j of row k holding outputs 8j + AWQ_ORDER[p] in its nibble p; ``qzeros`` [in / group, out / 8]
  packed the same way.
- GPTQ (``quant_method: "gptq"``, 4- or 8-bit, the v1 format AutoGPTQ and GPTQModel write):
  ``qweight`` [in * bits / 32, out], word i of column n holding inputs i * 32/bits + j in its bits
  j*bits..; ``qzeros`` [in / group, out * bits / 32] packed along the outputs, each stored as zero - 1;
  ``g_idx`` [in], the group of each input (act-order checkpoints, ``desc_act: true``, are refused).

Mapped as scale = s, min = -s * zero (rounded once to float16: relative error <= 2**-11 of s * zero);
8-bit codes are re-centred to signed (q - 128, min = s * (128 - zero)).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch

from lmport.config import ConfigError
from lmport.weights.format import QuantizedWeight, from_codes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED = {"awq": {"bits": (4,), "group_size": (64, 128)}, "gptq": {"bits": (4, 8), "group_size": (32, 64, 128)}}


def quantization_config(directory: Path) -> dict | None:
    config = json.loads((directory / "config.json").read_text())
    return config.get("quantization_config")


def weight_formats(directory: Path) -> set[tuple[int, int]]:
    """(bits, group size) from config.json's quantization_config; ConfigError for what cannot load."""
    q = quantization_config(directory)
    if q is None:
        return set()
    method = q.get("quant_method")
    where = f"{directory / 'config.json'} quantization_config"
    if method not in SUPPORTED:
        raise ConfigError(f"{where}: quant_method {method!r} is not supported (supported: {', '.join(SUPPORTED)})")
    bits, group = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size"))
    for key, value in (("bits", bits), ("group_size", group)):
        if value not in SUPPORTED[method][key]:
            raise ConfigError(f"{where}: {method} {key}={value!r} is not supported "
                              f"(supported: {SUPPORTED[method][key]})")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ConfigError(f"{where}: AWQ version {q.get('version')!r} is not supported (supported: GEMM packing)")
    if method == "gptq" and q.get("desc_act"):
        raise ConfigError(f"{where}: GPTQ desc_act=true (act-order, inputs regrouped by g_idx) is not supported; "
                          f"use a checkpoint quantized with desc_act=false")
    return {(int(bits), int(group))}   # both checked against SUPPORTED above


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., w] -> codes [..., w * 32/bits], value j of each word at bits j*bits.."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _to_internal(codes_kn: torch.Tensor, zeros_gn: torch.Tensor, scales_gn: torch.Tensor, bits: int,
                 group: int) -> QuantizedWeight:
    """Codes [in, out] (unsigned), zero points and scales [in / group, out] -> the internal format."""
    s = scales_gn.float().T                       # [out, groups]
    z = zeros_gn.float().T
    codes = codes_kn.T.contiguous()
    if bits == 8:
        return from_codes(codes.to(torch.int16) - 128, s, s * (128 - z), 8, group)
    return from_codes(codes, s, -s * z, 4, group)


def _awq(prefix: str, get, bits: int, group: int) -> QuantizedWeight:
    qweight, qzeros, scales = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    order = torch.tensor(AWQ_ORDER)

    def unpack(words):                            # [rows, out / 8] -> [rows, out], undoing AWQ's nibble order
        nibbles = _unpack_words(words, 4).unflatten(-1, (-1, 8))
        out = torch.empty_like(nibbles)
        out[..., order] = nibbles
        return out.flatten(-2)
    codes, zeros = unpack(qweight), unpack(qzeros)
    _check_shapes(prefix, codes, zeros, scales, group)
    return _to_internal(codes, zeros, scales, bits, group)


def _gptq(prefix: str, get, has, bits: int, group: int) -> QuantizedWeight:
    qweight, qzeros, scales = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    codes = _unpack_words(qweight.T, bits).T      # [in, out]
    zeros = _unpack_words(qzeros, bits) + 1       # v1 stores zero - 1
    _check_shapes(prefix, codes, zeros, scales, group)
    if has(f"{prefix}.g_idx"):
        g_idx = get(f"{prefix}.g_idx").long()
        if not torch.equal(g_idx, torch.arange(codes.shape[0]) // group):
            raise ValueError(f"{prefix}.g_idx is not input // {group}: an act-order (desc_act) checkpoint, "
                             f"which is not supported; use one quantized with desc_act=false")
    return _to_internal(codes, zeros, scales, bits, group)


def _check_shapes(prefix: str, codes, zeros, scales, group: int) -> None:
    k, n = codes.shape
    want = (k // group, n)
    if k % group or tuple(zeros.shape) != want or tuple(scales.shape) != want:
        raise ValueError(f"{prefix}: qweight unpacks to [in={k}, out={n}], so qzeros and scales must unpack to "
                         f"{list(want)} with group size {group}; found {list(zeros.shape)} and {list(scales.shape)}")


def load_tensors(directory: Path, dtype: torch.dtype) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """(quantized weights, float tensors) of an AWQ / GPTQ safetensors directory, transformers' names."""
    from safetensors import safe_open
    (bits, group), = weight_formats(directory)   # refuses a directory without a quantization_config
    q = cast(dict, quantization_config(directory))
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    if not tensors:
        raise ValueError(f"{directory}: no *.safetensors files")
    get, has = tensors.__getitem__, tensors.__contains__
    quantized, floats = {}, {}
    prefixes = sorted(name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight"))
    packed = {f"{p}.{s}" for p in prefixes for s in ("qweight", "qzeros", "scales", "g_idx")}
    for p in prefixes:
        try:
            if q["quant_method"] == "awq":
                quantized[f"{p}.weight"] = _awq(p, get, bits, group)
            else:
                quantized[f"{p}.weight"] = _gptq(p, get, has, bits, group)
        except KeyError as exc:
            raise ValueError(f"{directory}: {p} has a qweight but no {exc.args[0]}") from None
    for name, t in tensors.items():
        if name not in packed:
            floats[name] = t.to(dtype)
    return quantized, floats
