"""A quantized weight's inputs sliced in whole blocks of its type, for tensor parallelism: a rank's share of a
row-parallel projection (an expert's down projection) without dequantizing it."""
from __future__ import annotations

from lmport.errors import ConfigError
from lmport.weights.format import QuantizedWeight
from lmport.weights.ggml import GGMLWeight
from lmport.weights.residency import page_out

SPLIT_FIX = ("use a tp that splits it into whole blocks, or weight_format='dequantize' (--weight-format "
             "dequantize) to load the experts in the compute dtype and split those")


def input_range(value, start: int, stop: int, label: str):
    """Inputs ``start:stop`` of every row of a quantized weight (a copy): whole blocks of its type (ConfigError
    naming ``label`` where the range cuts one)."""
    if isinstance(value, GGMLWeight):
        elements, nbytes, kind = value.block_type.elements, value.block_type.nbytes, value.type_name
    else:
        elements, nbytes, kind = value.group_size, value.group_size * value.bits // 8, f"int{value.bits}"
    if start % elements or stop % elements:
        raise ConfigError(f"{label}: inputs {start}:{stop} cut {kind}'s {elements}-value blocks; "
                          f"{SPLIT_FIX}")
    if isinstance(value, GGMLWeight):
        picked = GGMLWeight(value.blocks[:, start // elements * nbytes:stop // elements * nbytes].contiguous(),
                            value.type_name, stop - start)
        page_out([value.blocks])   # copied out of the mapped file
        return picked
    groups = slice(start // elements, stop // elements)
    codes = slice(start * value.bits // 8, stop * value.bits // 8)   # 4-bit: whole 32-value runs of 16 bytes
    return QuantizedWeight(value.qweight[:, codes].contiguous(), value.scales[:, groups].contiguous(),
                           value.mins[:, groups].contiguous(), value.bits, value.group_size, value.zero_mins)
