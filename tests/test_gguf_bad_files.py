"""Bad GGUF files: each is refused with an error naming the tensor or key, before the engine starts.

Cases: a truncated download, a tensor of a type id no GGUF reader knows, a quantized type lmport has no
kernel form for, a tensor whose shape disagrees with the metadata, and an architecture lmport does not run.
A damaged header field, one case each: tests/test_gguf_header_checks.py.
"""
from __future__ import annotations

import shutil
import struct

import gguf
import numpy as np
import pytest

from lmport import EngineConfig
from lmport.config import ConfigError
from lmport.engine.engine import Engine
from lmport.weights.checkpoint import checkpoint_formats
from support.gguf_files import write_gguf
from support.tiny_hf_models import gguf_file, tiny_config, tiny_model

CPU = EngineConfig(device_type="cpu", cache_max_entry_count=16)


def test_a_truncated_file_names_the_tensor_past_its_end(tmp_path):
    path = tmp_path / "cut.gguf"
    data = gguf_file("llama").read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ConfigError, match=r"cut\.gguf.*tensor '.*' ends at byte .*truncated"):
        Engine(str(path), CPU)


def test_an_unknown_tensor_type_id_is_named(tmp_path):
    path = tmp_path / "unknown.gguf"
    shutil.copy(gguf_file("llama"), path)
    name = b"output_norm.weight"
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * dims, 99)     # the tensor's GGML type id
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"unknown\.gguf.*'output_norm\.weight' has GGML type 99"):
        Engine(str(path), CPU)


def test_a_type_without_a_kernel_form_is_refused_naming_the_tensors(tmp_path):
    path = tmp_path / "iq2.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    elements, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 256 // elements * nbytes), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_down\.weight \(IQ2_XXS\).*weight_format='dequantize'"):
        checkpoint_formats(path)


def test_a_tensor_whose_shape_disagrees_with_the_metadata_is_named(tmp_path):
    path = tmp_path / "shape.gguf"
    cfg = tiny_config("llama")
    cfg.intermediate_size *= 2             # the metadata says one width, the tensors have another
    write_gguf(path, cfg, tiny_model("llama").state_dict(), "Q8_0")
    with pytest.raises(ConfigError, match=r"shape\.gguf: llama\.feed_forward_length is 1024, should be 512, the "
                                          r"input width of blk\.0\.ffn_down\.weight"):   # the header check's
        Engine(str(path), CPU)


def test_an_architecture_lmport_does_not_run_is_refused_with_the_list(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"architecture 'falcon' is not supported; supported: llama .*phi3"):
        Engine(str(path), CPU)
