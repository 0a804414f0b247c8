"""Incremental decoding (lmport.engine.detokenize.IncrementalDecoder) against decoding the whole output:
after every token its text is the whole output's text up to the last complete character."""
from __future__ import annotations

import random

import pytest
from lmport.engine.detokenize import IncrementalDecoder
from lmport.models.loader import load_tokenizer

TEXT = ("Paged attention keeps keys and values in fixed-size blocks. Ünïcödé: naïve café, 日本語のテキスト, "
        "emoji 🚀🧪👩‍💻, math ∑∫√, tabs\tand  double  spaces, newlines\n\n  indented, code: `x = {'a': [1, 2]}`.")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def check_streams_like_whole(tokenizer, ids: list[int], skip_special_tokens: bool) -> None:
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
    for n in range(1, len(ids) + 1):
        text = decoder.update(ids[:n])
        whole = tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)
        assert whole.startswith(text), (n, text, whole)
        if "\ufffd" not in whole:   # every character complete: nothing held back
            assert text == whole, (n, text, whole)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_streams_as_the_whole_output_decodes(tokenizer, skip_special_tokens):
    ids = tokenizer.encode(TEXT)
    ids[40:40] = [tokenizer.eos_token_id, tokenizer.bos_token_id or 1]   # special tokens mid-output
    check_streams_like_whole(tokenizer, ids, skip_special_tokens)


def test_random_tokens_stream_as_the_whole_output_decodes(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        check_streams_like_whole(tokenizer, [rng.randrange(len(tokenizer)) for _ in range(60)], True)


def test_a_character_split_over_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1   # byte-level BPE: the emoji's 4 bytes come in more than one token
    decoder = IncrementalDecoder(tokenizer, True)
    assert [decoder.update(ids[:n]) for n in range(1, len(ids) + 1)] == [""] * (len(ids) - 1) + ["🚀"]
