"""Checks of a GGUF header, made before anything is allocated from it: a damaged header, or one not written by
llama.cpp's converter, is a ConfigError naming the field, its value and what it should be, instead of a
traceback or a model of 10^9 layers built from one number.

Two kinds. ``read_header`` makes the layout checks while it walks the file: counts and lengths against the
bytes left, the alignment, each tensor's dims. ``check_metadata`` then checks the model's numbers against
the tensors that hold them, as llama.cpp's loader checks every tensor's shape against its hyperparameters.
A file with no tensors at all (a vocabulary-only file, as llama.cpp ships for its tokenizer tests) has
nothing to check them against, so only the fields that stand on their own are checked there, and its layer
count against llama.cpp's bound.
"""
from __future__ import annotations

import math
import re
from typing import cast

from lmport.errors import ConfigError

MAX_DIMS = 4                           # GGML_MAX_DIMS
MAX_LAYERS = 512                       # LLAMA_MAX_LAYERS: llama.cpp loads no model of more
MIN_KV_BYTES = 8 + 4 + 1               # a metadata entry: key length, value type, the smallest value
MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8   # a tensor entry: name length, n_dims, one dim, type, offset
# The special tokens transformers' GGUF tokenizer looks up in the token list.
SPECIAL_TOKENS = ("bos", "eos", "unknown", "padding")
_LAYER = re.compile(r"blk\.(\d+)\.")


class DamagedHeader(ConfigError):
    def __init__(self, field: str, value, should: str):
        shown = "missing" if value is None else value
        super().__init__(f"{field} is {shown}, should be {should}: the file is damaged or was not written by "
                         f"llama.cpp's converter")


def check_count(field: str, count: int, each: int, room: int) -> None:
    """``count`` entries of at least ``each`` bytes must fit in the ``room`` bytes left of the file."""
    if count * each > room:
        left = f"the {room} bytes left in the file"
        raise DamagedHeader(field, count, f"at most {room}, {left}" if each == 1 else
                            f"at most {room // each}: each takes at least {each} bytes of {left}")


def check_alignment(value) -> None:
    if not _whole(value) or value < 1 or value & (value - 1):
        raise DamagedHeader("general.alignment", value, "a power of two (llama.cpp writes 32)")


def check_dims_count(tensor: str, n_dims: int) -> None:
    if n_dims > MAX_DIMS:
        raise DamagedHeader(f"n_dims of tensor {tensor!r}", n_dims, f"at most {MAX_DIMS}")


def check_tensor_size(tensor: str, shape: tuple[int, ...], nbytes: int, file_size: int) -> None:
    """The dims' product must fit a 64-bit count (torch and numpy index with one) and the bytes the file."""
    if math.prod(shape) >= 2 ** 63:
        raise DamagedHeader(f"the shape of tensor {tensor!r}", list(shape), "dims whose product fits in 64 bits")
    if nbytes > file_size:
        raise DamagedHeader(f"the shape of tensor {tensor!r}", list(shape),
                            f"dims of at most the whole file's {file_size} bytes (these take {nbytes})")


def check_metadata(metadata: dict, tensors: tuple) -> None:
    """The model's numbers in ``metadata`` (a supported architecture's) against ``tensors`` (TensorInfo)."""
    arch = metadata["general.architecture"]
    table = {t.name: t for t in tensors}
    _check_layers(metadata, arch, table)
    hidden = _check_width(metadata, f"{arch}.embedding_length", table, "token_embd.weight", -1, "width")
    _check_feed_forward(metadata, arch, table)
    _check_heads(metadata, arch, table, hidden)
    _check_vocabulary(metadata, arch, table)


def _check_layers(metadata: dict, arch: str, table: dict) -> None:
    if not table:   # no tensor to count the layers of: llama.cpp's own bound
        if (value := _positive(metadata, key := f"{arch}.block_count")) is not None and value > MAX_LAYERS:
            raise DamagedHeader(key, value, f"at most {MAX_LAYERS} (llama.cpp's LLAMA_MAX_LAYERS)")
        return
    layers = {int(m[1]) for name in table if (m := _LAYER.match(name))}
    count = max(layers) + 1 if layers else 0
    value = metadata.get(f"{arch}.block_count")
    # GLM-4.5's converter counts its multi-token-prediction layers in block_count, written or not
    extra = metadata.get(f"{arch}.nextn_predict_layers", 0)
    if value != count and not (extra and _whole(extra) and value == count + extra):
        held = f"blk.0 to blk.{count - 1}" if layers else "none"
        raise DamagedHeader(f"{arch}.block_count", value, f"{count}, the layers its tensor table holds ({held})")


def _check_width(metadata: dict, key: str, table: dict, tensor: str, axis: int, what: str) -> int | None:
    """``key`` (a whole number above 0) against ``tensor``'s dim ``axis``, each where present."""
    value = _positive(metadata, key)
    if value is not None and tensor in table and value != table[tensor].shape[axis]:
        shape = list(table[tensor].shape)
        raise DamagedHeader(key, value, f"{shape[axis]}, the {what} of {tensor} {shape}")
    return value


def _check_feed_forward(metadata: dict, arch: str, table: dict) -> None:
    _check_width(metadata, f"{arch}.feed_forward_length", table, "blk.0.ffn_down.weight", -1, "input width")
    experts_width = f"{arch}.expert_feed_forward_length"   # Qwen3-MoE's; Mixtral's experts use the dense key
    if experts_width not in metadata:
        experts_width = f"{arch}.feed_forward_length"
    # the first layer with experts (GLM-4.5's first layers are dense)
    down = next((name for name in table if name.endswith(".ffn_down_exps.weight")), "blk.0.ffn_down_exps.weight")
    _check_width(metadata, experts_width, table, down, -1, "input width")
    # A count of experts is a count of modules to build: checked like the layers.
    experts = _check_width(metadata, f"{arch}.expert_count", table, down, 0, "experts")
    used = _positive(metadata, f"{arch}.expert_used_count")
    if experts is not None and used is not None and used > experts:
        raise DamagedHeader(f"{arch}.expert_used_count", used, f"at most {arch}.expert_count ({experts})")


def _check_heads(metadata: dict, arch: str, table: dict, hidden: int | None) -> None:
    """Head counts and the head size against the attention tensors of layer 0: q has heads x head size rows,
    k and v kv heads x head size (Phi-3's fused qkv all three)."""
    heads_key, kv_key = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    heads = _positive(metadata, heads_key)
    if heads is None:
        return
    kv = _positive(metadata, kv_key) or heads
    if heads % kv:
        raise DamagedHeader(kv_key, kv, f"a divisor of {heads_key} ({heads})")
    # The head size: llama.cpp's key_length, which transformers reads for Llama as rope.dimension_count (llama.cpp
    # requires the two equal for Llama and SmolLM3), else the width over the heads.
    size_keys = [f"{arch}.attention.key_length"] + ([f"{arch}.rope.dimension_count"]
                                                    if arch in ("llama", "smollm3") else [])
    size_keys = [k for k in size_keys if k in metadata]
    if size_keys:
        source = size_keys[0]
        size = cast(int, _positive(metadata, source))   # the key is there: not None
        for key in size_keys[1:]:
            if metadata[key] != size:
                raise DamagedHeader(key, metadata[key], f"{size}, as {source} says")
    elif hidden is not None:
        if hidden % heads:
            raise DamagedHeader(heads_key, heads, f"a divisor of {arch}.embedding_length ({hidden})")
        size, source = hidden // heads, f"{arch}.embedding_length / {heads_key}"
    else:
        return
    for tensor, key, count in (("blk.0.attn_q.weight", heads_key, heads), ("blk.0.attn_k.weight", kv_key, kv)):
        if tensor in table and (rows := table[tensor].shape[0]) != count * size:
            raise DamagedHeader(key, count, f"{rows // size if rows % size == 0 else 'a whole number'}: {tensor} "
                                            f"has {rows} rows, heads of {size} ({source})")
    # Qwen3-Next's and Qwen3.5's attn_qkv is their linear-attention layers' q/k/v, not attention heads
    qkv = table.get("blk.0.attn_qkv.weight") if arch not in ("qwen3next", "qwen35", "qwen35moe") else None
    if qkv is not None and (rows := qkv.shape[0]) != (heads + 2 * kv) * size:
        raise DamagedHeader(f"{heads_key} / {kv_key}", f"{heads} / {kv}",
                            f"counts that fill blk.0.attn_qkv.weight's {rows} rows: q, k and v heads of {size} "
                            f"({source})")


def _check_vocabulary(metadata: dict, arch: str, table: dict) -> None:
    """The token list, the vocabulary size and the embedding's rows agree; special token ids index the list."""
    tokens = metadata.get("tokenizer.ggml.tokens")   # a string array not asked for: its length
    count = len(tokens) if isinstance(tokens, list) else tokens
    if "token_embd.weight" in table:
        rows = table["token_embd.weight"].shape[0]
        if count is not None and count != rows:
            raise DamagedHeader("tokenizer.ggml.tokens", f"a list of {count} tokens",
                                f"{rows} tokens, the rows of token_embd.weight")
        _check_width(metadata, f"{arch}.vocab_size", table, "token_embd.weight", 0, "rows")
        if "output.weight" in table and table["output.weight"].shape[0] != rows:
            raise DamagedHeader("the shape of tensor 'output.weight'", list(table["output.weight"].shape),
                                f"{rows} rows, one per token as token_embd.weight has")
        count = rows if count is None else count
    if count is None:
        return
    for kind in SPECIAL_TOKENS:
        value = metadata.get(key := f"tokenizer.ggml.{kind}_token_id")
        if value is not None and not (_whole(value) and 0 <= value < count):
            raise DamagedHeader(key, value, f"a token id below {count}, the size of the vocabulary")


def _positive(metadata: dict, key: str) -> int | None:
    """``metadata[key]``, which must be a whole number above 0; None where the key is absent."""
    value = metadata.get(key)
    if value is not None and not (_whole(value) and value > 0):
        raise DamagedHeader(key, value, "a whole number above 0")
    return value


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
