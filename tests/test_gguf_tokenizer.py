"""The tokenizer lmport builds from a GGUF's metadata is the one transformers' AutoTokenizer builds of the same
file: the same class, token ids, special tokens and chat template (lmport skips AutoTokenizer's config pass
over the whole file, lmport.models.loader.gguf_tokenizer).

Files: the default model and the tiny models of tests/support/tiny_hf_models.py written as GGUF (a byte-level
BPE vocabulary under each architecture's tokenizer class: Llama's, Gemma's, Qwen2's). What takes the time is
the reference: AutoTokenizer reads every metadata array with gguf's GGUFReader (10-20 s for the 49,152-token
vocabulary, on a 2-core machine). So `make test` runs the default model's file and, for every architecture, a
small file of the same metadata with the vocabulary cut to its first tokens (well under a second each); the
full-vocabulary files of every architecture are slow.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from lmport.models.loader import gguf_tokenizer, resolve_model_path
from lmport.weights.gguf_header import read_header
from support import gguf_files
from support.tiny_hf_models import ARCHS, gguf_file, tiny_config

TEXTS = ["Hello world! <|im_start|>user\n  naïve 123 你好", "  leading spaces\tand tabs\n\n",
         "<|endoftext|>x<|im_end|>"]
CASES = [pytest.param(name, marks=() if name == "smollm2" else pytest.mark.slow) for name in ("smollm2", *ARCHS)]
SMALL_VOCAB = 1000   # the special tokens, the 256 bytes and the first merges of the default model's vocabulary


def _path(name: str) -> Path:
    return resolve_model_path("smollm2") if name == "smollm2" else gguf_file(name)


def check_same_tokenizer(path: Path) -> None:
    from transformers import AutoTokenizer
    ours = gguf_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ours) is type(ref)
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ref(text).input_ids) == ref.decode(ref(text).input_ids)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                          ref.pad_token_id)
    chat = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("name", CASES)
def test_tokenizer_is_autotokenizers(name):
    check_same_tokenizer(_path(name))


def small_tokenizer_fields() -> tuple:
    """The default model's ``tokenizer.*`` fields (as support.gguf_files.default_model_tokenizer_fields gives
    them) with the vocabulary cut to its first SMALL_VOCAB tokens and the merges among those."""
    lists = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    meta = read_header(resolve_model_path("smollm2"), string_arrays=lists).metadata   # the fast reader
    tokens = meta["tokenizer.ggml.tokens"][:SMALL_VOCAB]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"]
              if (pair := m.split(" ")) and pair[0] in kept and pair[1] in kept and "".join(pair) in kept]
    small = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
             "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"][:SMALL_VOCAB]}
    kinds = gguf.GGUFValueType
    fields = []
    for key, value in meta.items():
        if key.startswith("tokenizer."):
            value = small.get(key, value)
            if isinstance(value, list):
                fields.append((key, value, kinds.ARRAY, kinds.STRING if isinstance(value[0], str) else kinds.INT32))
            else:   # bool before int: a bool is an int
                kind = {bool: kinds.BOOL, int: kinds.UINT32, str: kinds.STRING}[type(value)]
                fields.append((key, value, kind, None))
    return tuple(fields)


@pytest.fixture(scope="module")
def small_files(tmp_path_factory) -> dict[str, Path]:
    """Each architecture's metadata as support.gguf_files writes it, with the small vocabulary, no tensors."""
    fields = small_tokenizer_fields()
    files = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_files, "default_model_tokenizer_fields", lambda: fields)
        for arch in ARCHS:
            cfg = tiny_config(arch)
            files[arch] = tmp_path_factory.mktemp("small-vocab") / f"tiny-{arch}.gguf"
            writer = gguf.GGUFWriter(files[arch], gguf_files.GGUF_ARCH[cfg.model_type])
            gguf_files._write_metadata(writer, cfg, gguf_files.FILE_TYPES["F32"])
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.close()
    return files


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_of_a_small_vocabulary_is_autotokenizers(small_files, arch):
    assert read_header(small_files[arch]).metadata["tokenizer.ggml.tokens"] == SMALL_VOCAB   # not the default's
    check_same_tokenizer(small_files[arch])
