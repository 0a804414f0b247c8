"""A GGUF file's header: its metadata and tensor table, read in one pass; tensor data memory-mapped.

gguf's own ``GGUFReader`` builds a numpy view for every element of every metadata array (a
vocabulary of 50k tokens and its merges: seconds); this reads scalars and strings, keeps string
arrays only where asked (the tokenizer reads its own) and counts the rest. Layout: the GGUF
specification in llama.cpp's repository (versions 2 and 3: magic, version, tensor count, metadata
count, metadata key/type/values, the tensor table, the data section at the next multiple of
``general.alignment``).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmport.weights.gguf_checks import (MIN_KV_BYTES, MIN_TENSOR_BYTES, check_alignment, check_count,
                                        check_dims_count, check_tensor_size)
from lmport.weights.residency import map_file

# Fixed-size metadata value types: struct format by GGUF type id (8 = string, 9 = array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_FLOATS = {0: np.float32, 1: np.float16, 30: np.uint16}   # F32, F16, BF16 (read as raw 16-bit words)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]    # torch order (outermost first)
    ggml_type: int
    offset: int               # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict            # key -> value; a string array not asked for is its length
    tensors: tuple[TensorInfo, ...]
    data_start: int
    mapped: np.memmap = field(repr=False, compare=False)   # the whole file, mapped once

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes in the mapped file (uint8 [rows, row bytes]; float types as their values)."""
        raw = self.mapped[self.data_start + info.offset:self.data_start + info.offset + info.nbytes]
        if info.ggml_type in _FLOATS:
            return raw.view(_FLOATS[info.ggml_type]).reshape(info.shape)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return raw.reshape(rows, -1)


def read_header(path: Path, string_arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """ValueError naming the problem for a file that is not a GGUF, a version this does not read, or a
    tensor table that points past the end of the file (a truncated download); its subclass
    lmport.weights.gguf_checks.DamagedHeader for a count, length, alignment or dims the file cannot hold."""
    import gguf
    blob = map_file(path)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError("it does not start with the GGUF magic bytes")
    version, tensor_count, metadata_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (lmport reads versions 2 and 3)")
    check_count("metadata_kv_count", metadata_count, MIN_KV_BYTES, len(blob) - 24)
    check_count("tensor_count", tensor_count, MIN_TENSOR_BYTES, len(blob) - 24)
    pos, metadata = 24, {}
    for i in range(metadata_count):
        key, pos = _string(blob, pos, f"the length of metadata key {i}")
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, kind, key, key in string_arrays)
    tensors = []
    for i in range(tensor_count):
        name, pos = _string(blob, pos, f"the length of tensor name {i}")
        (dims,) = struct.unpack_from("<I", blob, pos)
        check_dims_count(name, dims)
        shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", blob, pos + 4)))
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        try:
            elements, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except ValueError:
            raise ValueError(f"tensor {name!r} has GGML type {ggml_type}, which no GGUF reader knows") from None
        if shape and shape[-1] % elements:
            raise ValueError(f"tensor {name!r}: {shape[-1]} inputs are not whole blocks of its type")
        size = math.prod(shape) // elements * nbytes   # exact: numpy's product would wrap around
        check_tensor_size(name, shape, size, len(blob))
        tensors.append(TensorInfo(name, shape, ggml_type, offset, size))
    alignment = metadata.get("general.alignment", 32)
    check_alignment(alignment)
    data_start = -(-pos // alignment) * alignment
    for t in tensors:
        if data_start + t.offset + t.nbytes > len(blob):
            raise ValueError(f"tensor {t.name!r} ends at byte {data_start + t.offset + t.nbytes}, past the end of "
                             f"the file ({len(blob)} bytes): the file is truncated")
    return GGUFHeader(path, metadata, tuple(tensors), data_start, blob)


def _string(blob: np.ndarray, pos: int, what: str) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    check_count(what, length, 1, len(blob) - pos - 8)
    return bytes(blob[pos + 8:pos + 8 + length]).decode("utf-8", errors="replace"), pos + 8 + length


def _value(blob: np.ndarray, pos: int, kind: int, key: str, keep_strings: bool):
    if kind in _SCALARS:
        (value,) = struct.unpack_from(_SCALARS[kind], blob, pos)
        return value, pos + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        return _string(blob, pos, f"the length of {key}")
    if kind != 9:
        raise ValueError(f"metadata value of unknown type {kind}")
    element, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element in _SCALARS:
        width = struct.calcsize(_SCALARS[element])
        check_count(f"the length of {key}", count, width, len(blob) - pos)
        return list(struct.unpack_from(f"<{count}{_SCALARS[element][1]}", blob, pos)), pos + count * width
    if element != 8:
        raise ValueError(f"metadata array of type {element}")
    check_count(f"the length of {key}", count, 8, len(blob) - pos)
    values = []
    for i in range(count):   # strings are of varying length: walk them
        (length,) = struct.unpack_from("<Q", blob, pos)
        if pos + 8 + length > len(blob):   # checked inline: this runs once per token of the vocabulary
            check_count(f"the length of {key}[{i}]", length, 1, len(blob) - pos - 8)
        if keep_strings:
            values.append(bytes(blob[pos + 8:pos + 8 + length]).decode("utf-8", errors="replace"))
        pos += 8 + length
    return (values if keep_strings else count), pos
