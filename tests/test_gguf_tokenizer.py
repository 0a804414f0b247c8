"""The tokenizer lmport builds from a GGUF's metadata is the one transformers' AutoTokenizer builds of the same
file: the same class, token ids, special tokens and chat template (lmport skips AutoTokenizer's config pass
over the whole file, lmport.models.loader.gguf_tokenizer).

Files: the default model and the tiny models of tests/support/tiny_hf_models.py written as GGUF (a byte-level
BPE vocabulary under each architecture's tokenizer class: Llama's, Gemma's, Qwen2's); in `make test` the
default model and Gemma 3, the others with the slow tests.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from lmport.models.loader import gguf_tokenizer, resolve_model_path
from support.tiny_hf_models import ARCHS, gguf_file

TEXTS = ["Hello world! <|im_start|>user\n  naïve 123 你好", "  leading spaces\tand tabs\n\n",
         "<|endoftext|>x<|im_end|>"]
QUICK = ("smollm2", "gemma3")
CASES = [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow) for name in ("smollm2", *ARCHS)]


def _path(name: str) -> Path:
    return resolve_model_path("smollm2") if name == "smollm2" else gguf_file(name)


@pytest.mark.parametrize("name", CASES)
def test_tokenizer_is_autotokenizers(name):
    from transformers import AutoTokenizer
    path = _path(name)
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
