"""GGUF tensors kept in their file's block layout (docs/weight-quantization.md).

Q4_0, Q4_1 and Q8_0 map bit for bit onto the internal int4 / int8 format (lmport.weights.format)
and load there. Every other GGUF quantized type lmport runs is held as the file stores it: a
weight [out, in] is ``out`` rows of ``in / elements`` blocks of ``nbytes`` each (llama.cpp's
``block_q4_K`` and friends), and the kernels read the blocks as they are. The K-quants' scales
are 6- or 8-bit multiples of a float16 super-block scale: no per-group float16 scale holds them
exactly, and a float32 one would grow a Q4_K weight by a third.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockType:
    name: str       # lower-case GGML type name, as Capabilities.ggml_types lists it
    elements: int   # weights a block holds (its inputs along one row)
    nbytes: int     # bytes a block takes


# The block types held as they are (sizes: llama.cpp's ggml-common.h, gguf.GGML_QUANT_SIZES).
BLOCK_TYPES = {t.name: t for t in (
    BlockType("q5_0", 32, 22), BlockType("q5_1", 32, 24),
    BlockType("q2_k", 256, 84), BlockType("q3_k", 256, 110), BlockType("q4_k", 256, 144),
    BlockType("q5_k", 256, 176), BlockType("q6_k", 256, 210),
    BlockType("iq4_nl", 32, 18), BlockType("iq4_xs", 256, 136),
)}
# Block types no backend has to declare: held as the file stores them all the same and run by a backend's kernel
# where it declares one (Capabilities.ggml_types: the cpu kernels read MXFP4), else by the torch reference on any
# device. MXFP4: gpt-oss's experts, as llama.cpp writes them (an e8m0 scale byte and 32 e2m1 values a block).
REFERENCE_BLOCK_TYPES = {t.name: t for t in (BlockType("mxfp4", 32, 17),)}
HELD_BLOCK_TYPES = BLOCK_TYPES | REFERENCE_BLOCK_TYPES


@dataclass(frozen=True)
class GGMLWeight:
    blocks: torch.Tensor   # uint8 [out, in / elements * nbytes]: each row's blocks as the file stores them
    type_name: str         # a key of HELD_BLOCK_TYPES
    in_features: int
    # 1: rows as the file stores them; 16: rows interleaved in groups of 16 for a backend's kernel
    # (lmport.weights.interleaved)
    row_group: int = 1

    @property
    def block_type(self) -> BlockType:
        return HELD_BLOCK_TYPES[self.type_name]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def rows(self, index: torch.Tensor) -> GGMLWeight:
        """The weight of the output rows ``index`` (an embedding lookup's rows, a q/k row permutation)."""
        if self.row_group != 1:
            raise ValueError(f"rows of a {self.type_name} weight interleaved in groups of {self.row_group}: "
                             "take them with lmport.weights.interleaved.file_rows")
        return GGMLWeight(self.blocks[index], self.type_name, self.in_features)

    def check(self, name: str = "weight") -> GGMLWeight:
        """Raises ValueError naming ``name`` when the tensor does not form a weight of its type."""
        if self.type_name not in HELD_BLOCK_TYPES:
            raise ValueError(f"{name}: GGML type {self.type_name!r} is not held as blocks "
                             f"(held: {', '.join(HELD_BLOCK_TYPES)})")
        t = self.block_type
        if self.in_features % t.elements:
            raise ValueError(f"{name}: {self.in_features} inputs are not a multiple of {t.name}'s "
                             f"{t.elements}-weight blocks")
        want = self.in_features // t.elements * t.nbytes
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != want:
            raise ValueError(f"{name}: {t.name} blocks of {self.in_features} inputs must be a 2-d uint8 tensor "
                             f"[out, {want}], got {self.blocks.dtype} {tuple(self.blocks.shape)}")
        return self


# MXFP4's e2m1 values, doubled (ggml's kvalues_mxfp4): each block's scale is taken at half its e8m0 value.
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def dequantize_mxfp4(weight: GGMLWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An MXFP4 weight [out, in] in ``dtype``, in torch on the weight's device (the reference op for MXFP4, as
    llama.cpp's ``dequantize_row_mxfp4``: each block's byte 0 an e8m0 scale, then 16 bytes whose low nibbles are
    values 0-15 and high nibbles 16-31). Exact: every value is a float32 (tests compare it with gguf's dequantizer)."""
    if weight.type_name != "mxfp4" or weight.row_group != 1:
        raise ValueError(f"dequantize_mxfp4 takes an mxfp4 weight in the file's row order, got {weight.type_name} "
                         f"(rows in groups of {weight.row_group})")
    blocks = weight.blocks.reshape(weight.out_features, -1, 17)
    e = blocks[..., 0].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 bits (subnormal below e = 2)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    half_scale = bits.view(torch.float32)
    qs = blocks[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.long)   # [out, blocks, 32]
    values = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=codes.device)[codes]
    return (values * half_scale[..., None]).reshape(weight.out_features, weight.in_features).to(dtype)
