"""GGUF tensors -> lmport's weights, kept quantized where the internal format holds them exactly.

Q4_0, Q4_1 and Q8_0 blocks (32 inputs, a float16 scale, Q4_1 also a float16 min) map onto the
internal format bit for bit (docs/weight-quantization.md). Every other quantized type (the
K-quants among them) is dequantized with gguf's reference dequantizer to the compute dtype,
and one log line names the types that were. Float tensors (norms) load as they are.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from lmport.weights.format import QuantizedWeight

log = logging.getLogger(__name__)

# GGUF tensor names -> transformers' (Llama / Qwen2 / Qwen3 / Mistral in llama.cpp's naming).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        if m.group(2) in _LAYER_NAMES:
            return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    elif base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no place in the model (known: token_embd, output, output_norm "
                     f"and blk.N.{{{', '.join(_LAYER_NAMES)}}})")


def _kept_types():
    from gguf import GGMLQuantizationType as T
    return {T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8}


def _float_types():
    from gguf import GGMLQuantizationType as T
    return {T.F32, T.F16, T.BF16}


def weight_formats(path: Path) -> set[tuple[int, int]]:
    """The (bits, group size) pairs the GGUF's kept tensors take, from its header (no tensor data read)."""
    import gguf
    kept = _kept_types()
    reader = gguf.GGUFReader(path)
    return {(kept[t.tensor_type], 32) for t in reader.tensors if t.tensor_type in kept}


def _blocks(t, bytes_per_block: int) -> np.ndarray:
    rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    return np.asarray(t.data).reshape(rows, -1, bytes_per_block)


def _quantized(t) -> QuantizedWeight:
    """One Q4_0 / Q4_1 / Q8_0 tensor in the internal format (copies the bytes out of the mapped file)."""
    from gguf import GGMLQuantizationType as T
    f16 = lambda b: torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0])  # noqa: E731
    if t.tensor_type == T.Q8_0:              # d: f16, qs: 32 x int8;           w = d * q
        b = _blocks(t, 34)
        scales = f16(b[..., 0:2])
        mins = torch.zeros_like(scales)
        codes = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8)).flatten(1)
        return QuantizedWeight(codes, scales, mins, 8, 32)
    if t.tensor_type == T.Q4_0:              # d: f16, qs: 16 bytes;            w = d * (q - 8)
        b = _blocks(t, 18)
        scales = f16(b[..., 0:2])
        mins = scales * -8                   # exact: a power-of-two multiple
        packed = b[..., 2:]
    else:                                    # Q4_1 -- d, m: f16, qs: 16 bytes; w = d * q + m
        b = _blocks(t, 20)
        scales, mins = f16(b[..., 0:2]), f16(b[..., 2:4])
        packed = b[..., 4:]
    codes = torch.from_numpy(np.ascontiguousarray(packed)).flatten(1)
    return QuantizedWeight(codes, scales, mins, 4, 32)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp stores Llama's q/k rows interleaved for its rotary; this index undoes it
    (transformers' reverse permutation, applied to whole rows, so it works on quantized rows too)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def load_tensors(path: Path, cfg, dtype: torch.dtype) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """(quantized weights, float tensors) of a GGUF under transformers' parameter names."""
    import gguf
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    kept, floats_types = _kept_types(), _float_types()
    quantized, floats, dequantized_types = {}, {}, set()
    for t in reader.tensors:
        name = hf_name(t.name)
        if t.tensor_type in kept:
            value = _quantized(t)
        elif t.tensor_type in floats_types:
            value = torch.from_numpy(np.array(t.data)).to(dtype).reshape(tuple(reversed(t.shape.tolist())))
        else:
            dequantized_types.add(t.tensor_type.name)
            value = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).to(dtype)
        if arch == "llama" and re.search(r"\.(q|k)_proj\.weight$", name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            index = _unpermute_rows(value.out_features if isinstance(value, QuantizedWeight) else value.shape[0],
                                    heads)
            value = value.rows(index) if isinstance(value, QuantizedWeight) else value[index]
        if isinstance(value, QuantizedWeight):
            quantized[name] = value.check(f"{t.name} ({t.tensor_type.name})")
        else:
            floats[name] = value
    if dequantized_types:
        log.info("%s: tensor types %s have no exact internal form and were dequantized to %s",
                 path.name, ", ".join(sorted(dequantized_types)), str(dtype).removeprefix("torch."))
    return quantized, floats


def planned_bytes(path: Path, dtype: torch.dtype) -> dict[str, int]:
    """Bytes the loaded weights will take, by format ("int4", "int8", or the compute dtype's name), from
    the GGUF header alone: what ``load_tensors`` keeps (a tied LM head shares its embedding's tensors)."""
    import gguf
    kept = _kept_types()
    by_format: dict[str, int] = {}
    float_name = str(dtype).removeprefix("torch.")
    for t in gguf.GGUFReader(path).tensors:
        numel = int(np.prod(t.shape))
        if t.tensor_type in kept:
            bits = kept[t.tensor_type]
            key, size = f"int{bits}", numel * bits // 8 + numel // 32 * 2 * 2   # codes + float16 scale and min a run
        else:
            key, size = float_name, numel * dtype.itemsize
        by_format[key] = by_format.get(key, 0) + size
    return by_format
