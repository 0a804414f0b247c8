"""Quantized weights with output rows interleaved in groups of 16: the layout the cpu backend's decode
kernels read (lmport/backends/cpu/csrc/interleaved_rows.h), the same bytes reordered. GGUF blocks
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
vpdpbusd lane sums. Q5_K's fifth bits go 4 bytes at a time too: qh byte j holds the fifth bits of inputs
j, 32 + j, .. of its 8 sub-blocks, so lane r of qh vector k has the fifth bits of the inputs that lane r of
each of the block's nibble vectors 8 c + k holds.

The int4 / int8 format's tensors go the same way, each over its whole row: ``qweight`` 4 bytes a unit
(lane r of vector k: row r's bytes 4 k .. 4 k + 3), ``scales`` and ``mins`` a float16 a unit (vector g:
the 16 rows' group g).

The rows past the last whole group stay as the file lays them out, after the groups. Every block keeps
its bytes (only Q5_0's fifth bits move bit by bit), so ``file_layout`` gives the file's bytes back
exactly: the reference ops read interleaved weights through it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

from lmport.weights import tensors
from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import GGMLWeight
from lmport.weights.residency import page_out

W = TypeVar("W", GGMLWeight, QuantizedWeight)
Kernel = Callable[[torch.Tensor, torch.Tensor, tuple, int], None]

GROUP = 16
NIBBLE = 0   # a unit of half a byte

# lmport's int4 / int8 format (lmport.weights.format): each tensor's rows as vectors of units of these bytes;
# codes 4 bytes at a time (8 inputs of int4 in its nibble order, 4 of int8), scales and mins one float16.
QUANTIZED_UNITS = {"qweight": 4, "scales": 2, "mins": 2}

# Each type's block as segments (start, length in bytes, unit); llama.cpp's ggml-common.h names them.
SEGMENTS = {
    "q5_0": ((0, 2, 2), (2, 4, NIBBLE), (6, 16, 4)),                    # d, qh, qs
    "q4_k": ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)),           # d, dmin, scales, qs
    "q5_k": ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 32, 4), (48, 128, 4)),   # d, dmin, scales, qh, qs
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


def interleave(weight: W, in_place: bool = False, kernel: Kernel | None = None) -> W:
    """``weight`` with its rows interleaved in groups of 16; the rows past the last whole group as they are.
    New tensors, or with ``in_place`` (``weight`` is not used after) each tensor torch allocated itself (a
    checkpoint's copy, merged projections) relaid where it lies, so that a model's memory does not grow while it
    is relaid; a view of a mapped file still goes to a new tensor (the file's pages can then go). ``kernel``:
    what relays whole groups in one pass, ``kernel(src, dst, segments, block_bytes)`` on uint8 [16 g, row bytes]
    (dst src itself or apart from it), to give the same bytes faster (the cpu backend's ``interleave_groups``);
    else torch does, a few groups at a time."""
    if weight.row_group != 1:
        raise ValueError(f"{_kind(weight)} weight is interleaved already (row_group={weight.row_group})")
    return _relaid(weight, GROUP, in_place, kernel)


def file_layout(weight: W) -> W:
    """``weight`` with its rows in order, as the file lays them out (itself where they are; else new tensors)."""
    if weight.row_group == 1:
        return weight
    if weight.row_group != GROUP or (isinstance(weight, GGMLWeight) and weight.type_name not in SEGMENTS):
        raise ValueError(f"{_kind(weight)} rows interleaved in groups of {weight.row_group}: no such layout "
                         f"(groups of {GROUP} of {', '.join(['int4', 'int8', *SEGMENTS])})")
    return _relaid(weight, 1, in_place=False)


def file_rows(weight: W, index: torch.Tensor) -> W:
    """Rows ``index`` (1-d) of ``weight`` as the file lays them out: an embedding lookup in the table of a
    tied LM head held interleaved puts back in order only the groups of the rows it looks up."""
    if weight.row_group == 1:
        return weight.rows(index)
    whole = weight.out_features // GROUP * GROUP
    grouped = index < whole
    groups = torch.unique(index[grouped] // GROUP)
    # the groups' rows (whole groups, so still interleaved), then the rows past the last whole group
    picked = torch.cat([(groups[:, None] * GROUP + torch.arange(GROUP)).reshape(-1),
                        torch.arange(whole, weight.out_features)])
    in_order = file_layout(dataclasses.replace(weight, **{name: t[picked] for name, t in tensors(weight).items()}))
    position = torch.where(grouped, torch.searchsorted(groups, index // GROUP) * GROUP + index % GROUP,
                           len(groups) * GROUP + index - whole)
    return in_order.rows(position)


def _kind(weight: GGMLWeight | QuantizedWeight) -> str:
    return f"int{weight.bits}" if isinstance(weight, QuantizedWeight) else weight.type_name


# Bytes relaid at a time: torch's transient copies stay this size, and a weight copied out of a mapped file is
# never whole in memory twice (each chunk's source pages go back as it is copied).
CHUNK_BYTES = 16 << 20


def _relaid(weight: W, row_group: int, in_place: bool, kernel: Kernel | None = None) -> W:
    """``weight`` with its rows interleaved (row_group 16) or in order (1)."""
    if isinstance(weight, QuantizedWeight):   # each tensor one block a row, of one segment
        layouts = {}
        for name, unit in QUANTIZED_UNITS.items():
            t = getattr(weight, name)
            row_bytes = t.numel() // t.shape[0] * t.element_size()
            layouts[name] = (((0, row_bytes, unit),), row_bytes)
    else:
        layouts = {"blocks": (SEGMENTS[weight.type_name], weight.block_type.nbytes)}
    relaid = {name: _relaid_rows(getattr(weight, name), segments, block_bytes, row_group, in_place, kernel)
              for name, (segments, block_bytes) in layouts.items()}
    return dataclasses.replace(weight, row_group=row_group, **relaid)


def _relaid_rows(t: torch.Tensor, segments, block_bytes: int, row_group: int, in_place: bool,
                 kernel: Kernel | None) -> torch.Tensor:
    """[rows, ...] ``t`` with its whole groups of 16 rows relaid, into ``t`` itself where in_place and torch owns
    its memory, else into a new tensor."""
    rows = t.contiguous()   # a transposed view (AWQ / GPTQ scales) as its rows: a copy of its own
    raw = rows.reshape(-1).view(torch.uint8).reshape(rows.shape[0], -1)   # flat first: a [rows, 1] view's stride
    # Relaid in place only where the bytes are the whole of an allocation torch made (resizable: not a mapped
    # file's or another library's buffer), so no other tensor's bytes move with them.
    storage = rows.untyped_storage()
    own = in_place and storage.resizable() and storage.nbytes() == raw.numel()
    out = raw if own else torch.empty_like(raw)
    whole = t.shape[0] // GROUP * GROUP
    if out is not raw:
        out[whole:] = raw[whole:]
    step = max(1, CHUNK_BYTES // (GROUP * raw.shape[1])) * GROUP
    for start in range(0, whole, step):
        chunk = slice(start, min(start + step, whole))
        if kernel is not None and row_group == GROUP:
            kernel(raw[chunk], out[chunk], segments, block_bytes)
        else:
            out[chunk] = _blocks(raw[chunk], segments, block_bytes, row_group)
        if in_place and out is not raw:   # the weight is not used after: its copied pages can go
            page_out([raw[chunk]])
    return out.reshape(-1).view(t.dtype).reshape(t.shape)


def _blocks(rows: torch.Tensor, segments, block_bytes: int, row_group: int) -> torch.Tensor:
    """Whole groups of rows [16 g, blocks x block_bytes] relaid."""
    blocks = rows.shape[1] // block_bytes
    if row_group == GROUP:
        groups = rows.reshape(-1, GROUP, blocks, block_bytes).transpose(1, 2)   # [groups, blocks, 16 rows, bytes]
        parts = [_segment_to_vectors(groups[..., start:start + length], unit) for start, length, unit in segments]
        return torch.cat(parts, -1).reshape(rows.shape)
    groups = rows.reshape(-1, blocks, GROUP * block_bytes)   # [groups, blocks, 16 x bytes]
    parts, at = [], 0
    for _, length, unit in segments:
        parts.append(_vectors_to_segment(groups[..., at:at + GROUP * length], unit))
        at += GROUP * length
    return torch.cat(parts, -1).transpose(1, 2).reshape(rows.shape)
