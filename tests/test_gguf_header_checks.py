"""Damaged GGUF headers: each is refused with a ConfigError naming the field, before anything is built from it.

Each file is the default model (or a tiny test model) with one header field rewritten in place: a count,
a length, a tensor's dims or a metadata value (lmport.weights.gguf_checks lists what is checked).
"""
from __future__ import annotations

import re
import struct

import pytest
import torch

from lmport import EngineConfig

from lmport.entrypoints import cli
from lmport.engine.engine import Engine
from lmport.errors import ConfigError
from lmport.models.loader import resolve_model_path
from support.tiny_hf_models import gguf_file

CPU = EngineConfig(device_type="cpu", cache_max_entry_count=16)
DAMAGED = "the file is damaged or was not written by llama.cpp's converter"
HEADER_BYTES = 4 << 20   # more than the default model's header (1.8 MB)
_FORMATS = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}   # the integer value types of these fields


def _after(data: bytearray, name: str) -> int:
    """The position just past the length-prefixed string ``name`` (a metadata key or a tensor name)."""
    raw = name.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def set_value(key: str, value: int):
    def edit(data: bytearray) -> bytearray:
        at = _after(data, key)
        (kind,) = struct.unpack_from("<I", data, at)
        struct.pack_into(_FORMATS[kind], data, at + 4, value)
        return data
    return edit


def set_dims(tensor: str, *dims: int):
    """The tensor's dims in GGUF order (innermost first)."""
    def edit(data: bytearray) -> bytearray:
        struct.pack_into(f"<{len(dims)}Q", data, _after(data, tensor) + 4, *dims)
        return data
    return edit


def set_n_dims(tensor: str, n_dims: int):
    def edit(data: bytearray) -> bytearray:
        struct.pack_into("<I", data, _after(data, tensor), n_dims)
        return data
    return edit


def set_count(offset: int, value: int):
    """The header's tensor count (offset 8) or metadata count (offset 16)."""
    def edit(data: bytearray) -> bytearray:
        struct.pack_into("<Q", data, offset, value)
        return data
    return edit


def set_string_length(key: str, length: int):
    def edit(data: bytearray) -> bytearray:
        struct.pack_into("<Q", data, _after(data, key) + 4, length)   # past the value's type
        return data
    return edit


def add_alignment(value: int):
    """A ``general.alignment`` entry first in the metadata (the default model has none)."""
    def edit(data: bytearray) -> bytearray:
        key = b"general.alignment"
        (count,) = struct.unpack_from("<Q", data, 16)
        struct.pack_into("<Q", data, 16, count + 1)
        return data[:24] + struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, value) + data[24:]
    return edit


@pytest.fixture
def damaged(tmp_path):
    """``damaged(edit, source=default model)`` -> the path of a copy of ``source`` with ``edit`` made to its
    header. Only the header is written: the tensor data is a hole of the same size (no check reads it)."""
    def write(edit, source=None):
        source = source or resolve_model_path("smollm2")
        size = source.stat().st_size
        with source.open("rb") as f:
            head = f.read(HEADER_BYTES)
        edited = edit(bytearray(head))
        path = tmp_path / "damaged.gguf"
        with path.open("wb") as f:
            f.write(edited)
            f.truncate(size + len(edited) - len(head))
        return str(path)
    return write


@pytest.fixture
def nothing_built(monkeypatch):
    """Building any torch module (the model's layers) fails the test: the header is checked first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a module was built from the damaged header before it was checked")
    monkeypatch.setattr(torch.nn.Module, "__init__", refuse)


# (edit, the message's field, value and expectation): one field each, all in the default model's header.
CASES = {
    "block_count_bomb": (set_value("llama.block_count", 10**9),
                         r"llama\.block_count is 1000000000, should be 30, the layers its tensor table holds"),
    "block_count_short": (set_value("llama.block_count", 29), r"llama\.block_count is 29, should be 30"),
    "embedding_length": (set_value("llama.embedding_length", 1152),
                         r"llama\.embedding_length is 1152, should be 576, the width of token_embd\.weight"),
    "feed_forward_length": (set_value("llama.feed_forward_length", 1537),
                            r"llama\.feed_forward_length is 1537, should be 1536"),
    "head_count_zero": (set_value("llama.attention.head_count", 0),
                        r"llama\.attention\.head_count is 0, should be a whole number above 0"),
    "head_count_shape": (set_value("llama.attention.head_count", 18),
                         r"llama\.attention\.head_count is 18, should be 9: blk\.0\.attn_q\.weight has 576 rows"),
    "head_count_kv_zero": (set_value("llama.attention.head_count_kv", 0), r"llama\.attention\.head_count_kv is 0"),
    "head_count_kv_divisor": (set_value("llama.attention.head_count_kv", 2),
                              r"llama\.attention\.head_count_kv is 2, should be a divisor of"),
    "rope_dimension_count": (set_value("llama.rope.dimension_count", 32),
                             r"llama\.attention\.head_count is 9, should be 18: .*heads of 32 "
                             r"\(llama\.rope\.dimension_count\)"),
    "vocab_size": (set_value("llama.vocab_size", 50000), r"llama\.vocab_size is 50000, should be 49152"),
    "tokens": (set_dims("token_embd.weight", 576, 49151),
               r"tokenizer\.ggml\.tokens is a list of 49152 tokens, should be 49151 tokens"),
    "bos_token_id": (set_value("tokenizer.ggml.bos_token_id", 49152),
                     r"tokenizer\.ggml\.bos_token_id is 49152, should be a token id below 49152"),
    "eos_token_id": (set_value("tokenizer.ggml.eos_token_id", 10**6), r"tokenizer\.ggml\.eos_token_id is 1000000"),
    "padding_token_id": (set_value("tokenizer.ggml.padding_token_id", 10**6),
                         r"tokenizer\.ggml\.padding_token_id is 1000000"),
    "alignment_zero": (add_alignment(0), r"general\.alignment is 0, should be a power of two"),
    "alignment_not_power_of_two": (add_alignment(24), r"general\.alignment is 24, should be a power of two"),
    "kv_count": (set_count(16, 2**63), r"metadata_kv_count is 9223372036854775808, should be at most \d+"),
    "tensor_count": (set_count(8, 2**40), r"tensor_count is 1099511627776, should be at most \d+"),
    "string_length": (set_string_length("general.name", 2**62), r"the length of general\.name is \d+, should be"),
    "n_dims": (set_n_dims("token_embd.weight", 2**31 - 1),
               r"n_dims of tensor 'token_embd\.weight' is 2147483647, should be at most 4"),
    "dims_overflow": (set_dims("token_embd.weight", 2**40, 2**40),
                      r"the shape of tensor 'token_embd\.weight' is \[1099511627776, 1099511627776\], should be dims "
                      r"whose product fits in 64 bits"),
    "dims_past_the_file": (set_dims("token_embd.weight", 576, 2**33),
                           r"the shape of tensor 'token_embd\.weight' is \[8589934592, 576\], should be dims of at "
                           r"most the whole file's \d+ bytes"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_header_field_is_named_before_the_engine_builds_anything(case, damaged, nothing_built):
    edit, message = CASES[case]
    with pytest.raises(ConfigError, match=rf"damaged\.gguf: {message}.*{DAMAGED}"):
        Engine(damaged(edit), CPU)


# Fields the default model has no tensor for, in the tests' tiny models (tests/support/gguf_files.py).
TINY_CASES = {
    "expert_count": ("mixtral", set_value("llama.expert_count", 10**9),
                     r"llama\.expert_count is 1000000000, should be 4, the experts of blk\.0\.ffn_down_exps"),
    "expert_used_count": ("mixtral", set_value("llama.expert_used_count", 5),
                          r"llama\.expert_used_count is 5, should be at most llama\.expert_count \(4\)"),
    "expert_feed_forward_length": ("qwen3-moe", set_value("qwen3moe.expert_feed_forward_length", 1000),
                                   r"qwen3moe\.expert_feed_forward_length is 1000, should be 768"),
    "fused_qkv_heads": ("phi3", set_value("phi3.attention.head_count_kv", 1),
                        r"phi3\.attention\.head_count / phi3\.attention\.head_count_kv is 4 / 1, should be counts "
                        r"that fill blk\.0\.attn_qkv\.weight's 512 rows"),
    "output_rows": ("llama", set_dims("output.weight", 256, 49151),
                    r"the shape of tensor 'output\.weight' is \[49151, 256\], should be 49152 rows"),
}


@pytest.fixture
def tiny_source(case):
    """The case's tiny GGUF file, made (a model is built to write it, on a fresh machine) before nothing_built."""
    return gguf_file(TINY_CASES[case][0])


@pytest.mark.parametrize("case", TINY_CASES)
def test_a_damaged_header_of_another_architecture_is_named(case, tiny_source, damaged, nothing_built):
    _, edit, message = TINY_CASES[case]
    with pytest.raises(ConfigError, match=rf"damaged\.gguf: {message}.*{DAMAGED}"):
        Engine(damaged(edit, tiny_source), CPU)


@pytest.mark.parametrize("case", ["block_count_bomb", "head_count_zero", "alignment_zero", "bos_token_id"])
def test_lmport_plan_prints_the_error_not_a_traceback(case, damaged, nothing_built, capsys):
    edit, message = CASES[case]
    assert cli.main(["plan", damaged(edit), "--device", "cpu", "--device-memory", "8GiB"]) == 2
    assert re.fullmatch(rf"error: damaged\.gguf: {message}.*{DAMAGED}\n", capsys.readouterr().err, re.S)


def test_a_file_without_tensors_is_held_to_llama_cpps_layer_bound(tmp_path, nothing_built, capsys):
    """A vocabulary-only file (no tensor to count layers against) claiming 10^9 layers: refused by the bound
    llama.cpp loads models under, not built layer by layer."""
    import gguf
    path = tmp_path / "damaged.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(10**9)
    for add, value in ((writer.add_context_length, 2048), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4)):
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = r"llama\.block_count is 1000000000, should be at most 512 \(llama\.cpp's LLAMA_MAX_LAYERS\)"
    with pytest.raises(ConfigError, match=rf"damaged\.gguf: {message}.*{DAMAGED}"):
        Engine(str(path), CPU)
    assert cli.main(["plan", str(path), "--device", "cpu", "--device-memory", "8GiB"]) == 2
    assert re.fullmatch(rf"error: damaged\.gguf: {message}.*{DAMAGED}\n", capsys.readouterr().err, re.S)
