"""The one internal quantized-weight format (docs/weight-quantization.md).

A weight [out, in] is cut, along ``in``, into groups of ``group_size`` inputs (a multiple of 32);
each group of each output row has one ``scale`` and one ``min`` (float16), and

    w = scale * q + min

for the group's integer codes ``q``:

- 4-bit: unsigned codes 0..15, two a byte, ``qweight`` uint8 [out, in / 2]. Inside each run of 32
  inputs, byte j holds input j in its low nibble and input j + 16 in its high nibble (GGUF's
  Q4_0 / Q4_1 order, so their blocks load as they are).
- 8-bit: signed codes -128..127, ``qweight`` int8 [out, in] (GGUF's Q8_0 codes as they are).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmport.errors import ConfigError

BLOCK = 32          # inputs per packing run; group sizes are multiples of it
BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedWeight:
    qweight: torch.Tensor   # uint8 [out, in/2] (4-bit) or int8 [out, in] (8-bit)
    scales: torch.Tensor    # float16 [out, in/group_size]
    mins: torch.Tensor      # float16 [out, in/group_size]
    bits: int
    group_size: int
    zero_mins: bool = False   # every min is 0 (GGUF's Q8_0: w = scale * q): a kernel may skip them
    # 1: rows in order; 16: rows interleaved in groups of 16 for a backend's kernel (lmport.weights.interleaved)
    row_group: int = 1

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8 // self.bits

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the output rows ``index`` (an embedding lookup's rows)."""
        if self.row_group != 1:
            raise ValueError(f"rows of an int{self.bits} weight interleaved in groups of {self.row_group}: take them "
                             "with lmport.weights.interleaved.file_rows")
        return QuantizedWeight(self.qweight[index], self.scales[index], self.mins[index], self.bits, self.group_size,
                               self.zero_mins)

    def check(self, name: str = "weight") -> QuantizedWeight:
        """Raises ValueError naming ``name`` when the tensors do not form a weight of this format."""
        n = self.qweight.shape[0]
        if self.bits not in BITS:
            raise ValueError(f"{name}: {self.bits}-bit weights are not supported (supported: {BITS})")
        if self.group_size % BLOCK or self.group_size <= 0:
            raise ValueError(f"{name}: group size {self.group_size} is not a positive multiple of {BLOCK}")
        want_dtype = torch.uint8 if self.bits == 4 else torch.int8
        if self.qweight.dtype != want_dtype or self.qweight.dim() != 2:
            raise ValueError(f"{name}: {self.bits}-bit codes must be a 2-d {want_dtype} tensor, "
                             f"got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        k = self.in_features
        if k % self.group_size:
            raise ValueError(f"{name}: {k} inputs are not a multiple of the group size {self.group_size}")
        for label, t in (("scales", self.scales), ("mins", self.mins)):
            if t.dtype != torch.float16 or tuple(t.shape) != (n, k // self.group_size):
                raise ValueError(f"{name}: {label} must be float16 [{n}, {k // self.group_size}], "
                                 f"got {t.dtype} {tuple(t.shape)}")
        return self


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes [out, in] (values 0..15) -> uint8 [out, in/2] in the format's nibble order."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> codes uint8 [out, in] (the inverse of ``pack_int4``)."""
    n = packed.shape[0]
    blocks = packed.reshape(n, -1, BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(n, -1)


def from_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
               group_size: int) -> QuantizedWeight:
    """A QuantizedWeight from integer codes [out, in] (4-bit: 0..15; 8-bit: -128..127)."""
    if bits == 4:
        qweight = pack_int4(codes)
    else:
        qweight = codes.to(torch.int8)
    return QuantizedWeight(qweight.contiguous(), scales.to(torch.float16).contiguous(),
                           mins.to(torch.float16).contiguous(), bits, group_size)


def check_quantized_tp(tp: int, checkpoint: str, quantized: bool, can_dequantize: bool) -> None:
    """The rule for quantized weights under tensor parallelism, for every caller (the engine, the loader,
    ``lmport plan``, lmport.parallel): lmport does not shard a quantized weight, so a checkpoint whose weights
    stay quantized runs at tp=1 (docs/weight-quantization.md, "Tensor parallelism"). ``can_dequantize``:
    weight_format='dequantize' loads it in the compute dtype, which shards."""
    if tp > 1 and quantized:
        fix = ("use tp=1 to run them quantized, or weight_format='dequantize' (--weight-format dequantize) to load "
               "them in the compute dtype and shard those") if can_dequantize else "use tp=1"
        raise ConfigError(f"tp={tp}: {checkpoint} holds quantized weights, which lmport does not shard (they run "
                          f"at tp=1); {fix}")
