"""Quantized weights with output rows interleaved in groups of 16: the layout the cpu backend's decode
kernels read (backends/cpu/csrc/interleaved_rows.h), the same bytes reordered. GGUF blocks
(lmport.weights.ggml) and lmport's int4 / int8 format (lmport.weights.format) alike.

A decode step dots one x with every weight row. Row by row, each row's sums end in a horizontal add
and each block's scales are read and spread across the vector on their own. With 16 rows
interleaved, vector lane r holds row r: a block's codes of 16 rows meet x's codes for those inputs
broadcast to every lane, the 16 rows' scales are one load and their results one store. llama.cpp
repacks its Q4_0 and Q4_K weights for the same reason (``ggml-cpu/repack.cpp``).

Block i of a group is its 16 rows' block i, segment by segment in the file's order: a segment of
``length`` bytes that the kernel reads ``unit`` bytes at a time becomes length / unit vectors, vector k
holding unit k of row 0, of row 1, ... of row 15. Q5_0's fifth bits go 4 at a time (a unit of half a
byte: vector k is a 64-bit mask, bits 4 r .. 4 r + 3 being row r's inputs 4 k .. 4 k + 3). So with
4-byte units of nibbles, lane r of vector k is row r's bytes 4 k .. 4 k + 3, the four inputs one
vpdpbusd lane sums.

The int4 / int8 format's tensors go the same way, each over its whole row: ``qweight`` 4 bytes a unit
(lane r of vector k: row r's bytes 4 k .. 4 k + 3), ``scales`` and ``mins`` a float16 a unit (vector g:
the 16 rows' group g).

The rows past the last whole group stay as the file lays them out, after the groups. Every block keeps
its bytes (only Q5_0's fifth bits move bit by bit), so ``file_layout`` gives the file's bytes back
exactly: the reference ops read interleaved weights through it.
"""
from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import GGMLWeight

W = TypeVar("W", GGMLWeight, QuantizedWeight)

GROUP = 16
NIBBLE = 0   # a unit of half a byte

# lmport's int4 / int8 format (lmport.weights.format): each tensor's rows as vectors of units of these bytes;
# codes 4 bytes at a time (8 inputs of int4 in its nibble order, 4 of int8), scales and mins one float16.
QUANTIZED_UNITS = {"qweight": 4, "scales": 2, "mins": 2}

# Each type's block as segments (start, length in bytes, unit); llama.cpp's ggml-common.h names them.
SEGMENTS = {
    "q5_0": ((0, 2, 2), (2, 4, NIBBLE), (6, 16, 4)),                    # d, qh, qs
    "q4_k": ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)),           # d, dmin, scales, qs
    "q6_k": ((0, 128, 4), (128, 64, 4), (192, 16, 1), (208, 2, 2)),     # ql, qh, scales, d
}


def _bits(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> its bits [..., 8 n], least significant first."""
    return ((b.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=b.device)) & 1).flatten(-2)


def _bytes(bits: torch.Tensor) -> torch.Tensor:
    """Bits [..., 8 n] (0 / 1, least significant first) -> uint8 [..., n]."""
    bits = bits.unflatten(-1, (-1, 8))
    out = bits[..., 0].clone()
    for i in range(1, 8):
        out |= bits[..., i] << i
    return out


def _segment_to_vectors(seg: torch.Tensor, unit: int) -> torch.Tensor:
    """[..., 16 rows, length] -> [..., 16 x length]: unit k of every row, for each k."""
    if unit == NIBBLE:
        bits = _bits(seg).unflatten(-1, (-1, 4)).transpose(-3, -2)   # [..., units, rows, 4]
        return _bytes(bits.flatten(-3))
    return seg.unflatten(-1, (-1, unit)).transpose(-3, -2).flatten(-3)


def _vectors_to_segment(vec: torch.Tensor, unit: int) -> torch.Tensor:
    """The inverse: [..., 16 x length] -> [..., 16 rows, length]."""
    if unit == NIBBLE:
        bits = _bits(vec).unflatten(-1, (-1, GROUP, 4)).transpose(-3, -2)   # [..., rows, units, 4]
        return _bytes(bits.flatten(-2))
    return vec.unflatten(-1, (-1, GROUP, unit)).transpose(-3, -2).flatten(-2)


def interleave(weight: W) -> W:
    """``weight`` with its rows interleaved in groups of 16 (new tensors; the rows past the last whole group
    as they are)."""
    if weight.row_group != 1:
        raise ValueError(f"{_kind(weight)} weight is interleaved already (row_group={weight.row_group})")
    if isinstance(weight, QuantizedWeight):
        return dataclasses.replace(weight, row_group=GROUP, **{name: _tensor_vectors(getattr(weight, name), unit)
                                                                for name, unit in QUANTIZED_UNITS.items()})
    groups = _whole_groups(weight).transpose(1, 2)   # [groups, blocks, 16 rows, bytes]
    parts = [_segment_to_vectors(groups[..., start:start + length], unit)
             for start, length, unit in SEGMENTS[weight.type_name]]
    return _with_groups(weight, torch.cat(parts, -1), GROUP)


def file_layout(weight: W) -> W:
    """``weight`` with its rows as the file lays them out (itself where they are)."""
    if weight.row_group == 1:
        return weight
    if isinstance(weight, QuantizedWeight):
        if weight.row_group != GROUP:
            raise ValueError(f"{_kind(weight)} rows interleaved in groups of {weight.row_group}: no such layout "
                             f"(groups of {GROUP})")
        return dataclasses.replace(weight, row_group=1, **{name: _tensor_rows(getattr(weight, name), unit)
                                                            for name, unit in QUANTIZED_UNITS.items()})
    if weight.row_group != GROUP or weight.type_name not in SEGMENTS:
        raise ValueError(f"{weight.type_name} rows interleaved in groups of {weight.row_group}: no such layout "
                         f"(groups of {GROUP} of {', '.join(SEGMENTS)})")
    stored = _whole_groups(weight)
    groups = stored.reshape(stored.shape[0], stored.shape[2], -1)   # [groups, blocks, 16 x bytes]
    parts, at = [], 0
    for _, length, unit in SEGMENTS[weight.type_name]:
        parts.append(_vectors_to_segment(groups[..., at:at + GROUP * length], unit))
        at += GROUP * length
    return _with_groups(weight, torch.cat(parts, -1).transpose(1, 2), 1)


def _kind(weight: GGMLWeight | QuantizedWeight) -> str:
    return f"int{weight.bits}" if isinstance(weight, QuantizedWeight) else weight.type_name


def _whole_groups(weight: GGMLWeight) -> torch.Tensor:
    """The whole groups' bytes as [groups, 16 rows, blocks, bytes] (rows as stored)."""
    t = weight.block_type
    whole = weight.out_features // GROUP * GROUP
    return weight.blocks[:whole].reshape(-1, GROUP, weight.in_features // t.elements, t.nbytes)


def _with_groups(weight: GGMLWeight, groups: torch.Tensor, row_group: int) -> GGMLWeight:
    """``weight`` with its whole groups' bytes replaced by ``groups`` (any shape of them, in order)."""
    whole = weight.out_features // GROUP * GROUP
    blocks = torch.cat([groups.reshape(whole, -1), weight.blocks[whole:]])
    return dataclasses.replace(weight, blocks=blocks, row_group=row_group)


def _tensor_vectors(t: torch.Tensor, unit: int) -> torch.Tensor:
    """A [rows, ...] tensor's whole groups of 16 rows as vectors of ``unit`` bytes, unit k of each row in turn."""
    raw, whole = t.view(torch.uint8), t.shape[0] // GROUP * GROUP
    groups = raw[:whole].reshape(-1, GROUP, raw.shape[1] // unit, unit).transpose(1, 2)
    return torch.cat([groups.reshape(whole, -1), raw[whole:]]).view(t.dtype)


def _tensor_rows(t: torch.Tensor, unit: int) -> torch.Tensor:
    """The inverse of _tensor_vectors."""
    raw, whole = t.view(torch.uint8), t.shape[0] // GROUP * GROUP
    groups = raw[:whole].reshape(-1, raw.shape[1] // unit, GROUP, unit).transpose(1, 2)
    return torch.cat([groups.reshape(whole, -1), raw[whole:]]).view(t.dtype)
