"""A GGUF's tokenizer as llama.cpp reads it (its src/llama-vocab.cpp), built as a ``tokenizers`` Tokenizer.

Why lmport builds it rather than taking transformers' GGUF converter: transformers builds the tokenizer
class of the file's architecture and lets that class add the special tokens it expects. A DeepSeek-R1
distill (a Qwen2 file) got three tokens the file does not have, its BOS at an id past the model's
vocabulary, and its control tokens ``<｜User｜>``, ``<｜Assistant｜>`` tokenized as text. The file itself
says all llama.cpp uses, so lmport reads exactly that and nothing else:

- ``tokenizer.ggml.tokens`` in id order: the vocabulary, never extended (every id is below its length);
- ``tokenizer.ggml.token_type``: control, user-defined and unknown tokens are matched in the text before
  anything else (llama.cpp's special-token partition with ``parse_special``, as transformers matches added
  tokens), control and unknown ones are skipped by ``decode(skip_special_tokens=True)``; normal, unused
  and byte tokens are plain vocabulary;
- ``tokenizer.ggml.model``: ``gpt2`` is byte-level BPE over ``tokenizer.ggml.merges`` after the regex
  pre-split that ``tokenizer.ggml.pre`` names (the table below, copied from llama.cpp's
  ``llm_tokenizer_bpe``); ``llama`` is SentencePiece: spaces as ``▁``, pieces merged by score, bytes
  (``<0xNN>``) for what no piece covers, a ``▁`` before each text span when ``add_space_prefix``;
- ``bos`` / ``eos`` / ``unknown`` / ``padding`` token ids and ``add_bos_token`` / ``add_eos_token`` /
  ``add_space_prefix``, with llama.cpp's defaults where a key is absent;
- ``tokenizer.chat_template``.

It is wrapped in transformers' ``TokenizersBackend`` so the rest of lmport (chat templates, decode, the
special-token attributes) uses it as any transformers tokenizer.

Limits: ``tokenizer.ggml.model`` other than ``gpt2`` and ``llama`` (BERT, T5, RWKV vocabularies) and a
``tokenizer.ggml.pre`` missing from the table raise ``UnsupportedTokenizer`` naming it. Where several
special tokens overlap in a text, transformers matches the leftmost-longest and llama.cpp the longest
token first; no model's tokens overlap that way.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# llama.cpp's llama_token_type (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp's pre-tokenizer types: the regexes each applies in turn (each splits what the one before left,
# keeping both the matches and the text between them), and whether a word that is itself a token skips the
# merges (``ignore_merges``).
_PRE_TYPES: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False),
    "llama3": ((_LLAMA3,), True),
    "dbrx": ((_LLAMA3,), False),
    # escaped: these ranges hold characters that a text editor's normalization (NFC) would change
    "deepseek-llm": (("[\r\n]",
                      "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-"
                      "\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7"
                      "-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
                      "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-"
                      "\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
                      "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
                      "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c"
                      "-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
                      "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
                      "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
                      "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
                      "]+",
                      "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                      "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}+"), False),
    "deepseek-coder": (("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                        r"\p{N}"), False),
    "deepseek-v3": ((r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), False),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                "[0-9][0-9][0-9]"), False),
    "starcoder": ((r"\p{N}", _GPT2), False),
    "gpt2": ((_GPT2,), False),
    "qwen2": ((_QWEN2,), False),
    "qwen35": ((_QWEN35,), False),
    "chatglm4": ((_LLAMA3,), False),
    "glm4": ((_LLAMA3,), True),
    "tekken": ((_TEKKEN,), True),
    "gpt4o": ((_GPT4O,), False),
    "seed-coder": ((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                    r"|\s+(?!\S)|\s+",), False),
    "bailingmoe": ((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",), False),
    "minicpm5": ((r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"), True),
}

# ``tokenizer.ggml.pre`` -> llama.cpp's pre-tokenizer type (llama_vocab::impl::load), for the families whose
# regexes are in the table above.
PRE_TOKENIZERS: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "dbrx"),
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), "deepseek-v3"),
    "falcon": "falcon",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
                     "mellum2"), "starcoder"),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
                     "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
                     "modern-bert"), "gpt2"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open"), "qwen2"),
    "qwen35": "qwen35",
    "chatglm-bpe": "chatglm4",
    **dict.fromkeys(("glm4", "glm5"), "glm4"),
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    "seed-coder": "seed-coder",
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "minicpm5": "minicpm5",
}
# Pre-tokenizers after which llama.cpp adds a BOS by default (before ``tokenizer.ggml.add_bos_token``).
_ADDS_BOS = {"llama3", "tekken"}


class UnsupportedTokenizer(ValueError):
    pass


@dataclass(frozen=True)
class GGUFVocab:
    """The ``tokenizer.*`` metadata of a GGUF, with llama.cpp's defaults filled in."""
    model: str                  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str                    # tokenizer.ggml.pre ("" for SentencePiece)
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    name: str                   # general.name (llama.cpp keys per-token attributes on it)
    chat_template: str | None

    @classmethod
    def from_metadata(cls, meta: dict) -> GGUFVocab:
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise UnsupportedTokenizer("the GGUF has no tokenizer.ggml.tokens: it carries no tokenizer (give "
                                       "lmport a GGUF converted with its tokenizer, or the model's HF directory)")
        n = len(tokens)
        # llama.cpp names an empty token [EMPTY_<id>]
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        if model == "gpt2":
            pre = meta.get("tokenizer.ggml.pre") or "default"
            if pre not in PRE_TOKENIZERS:
                raise UnsupportedTokenizer(
                    f"tokenizer.ggml.pre is {pre!r}, a pre-tokenizer lmport does not know (it knows "
                    f"{', '.join(sorted(PRE_TOKENIZERS))}); use the model's HF directory instead of the GGUF")
            bos = eos = 11
            unk = None
            add_bos, add_eos, add_space_prefix = PRE_TOKENIZERS[pre] in _ADDS_BOS, False, False
        elif model == "llama":
            pre = ""
            bos, eos, unk = 1, 2, 0
            add_bos, add_eos, add_space_prefix = True, False, True
        else:
            raise UnsupportedTokenizer(f"tokenizer.ggml.model is {model!r}; lmport builds GGUF tokenizers of "
                                       f"the 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) kinds; use the "
                                       f"model's HF directory instead of the GGUF")

        def token_id(key: str, default: int | None) -> int | None:
            # an id past the vocabulary is refused, as llama.cpp does (it keeps its default)
            value = meta.get(f"tokenizer.ggml.{key}", default)
            value = value if isinstance(value, int) and 0 <= value < n else default
            return value if value is not None and 0 <= value < n else None

        types = meta.get("tokenizer.ggml.token_type")
        scores = meta.get("tokenizer.ggml.scores")
        merges = meta.get("tokenizer.ggml.merges")
        if model == "gpt2" and not isinstance(merges, list):
            raise UnsupportedTokenizer("a 'gpt2' (BPE) GGUF tokenizer without tokenizer.ggml.merges (the file is "
                                       "damaged or was not made by llama.cpp's converter)")
        return cls(model=model, pre=pre, tokens=tokens,
                   types=list(types[:n]) if isinstance(types, list) and len(types) >= n else [NORMAL] * n,
                   scores=[float(s) for s in scores[:n]] if isinstance(scores, list) and len(scores) >= n
                   else [0.0] * n,
                   merges=merges if isinstance(merges, list) else [],
                   bos_id=token_id("bos_token_id", bos), eos_id=token_id("eos_token_id", eos),
                   unk_id=token_id("unknown_token_id", unk), pad_id=token_id("padding_token_id", None),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)),
                   add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", add_eos)),
                   add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix)),
                   name=str(meta.get("general.name", "")), chat_template=meta.get("tokenizer.chat_template"))

    def matched_first(self, i: int) -> bool:
        """Whether llama.cpp splits token ``i`` out of the text before tokenizing the rest."""
        return self.types[i] in (CONTROL, USER_DEFINED, UNKNOWN)

    def special(self, i: int) -> bool:
        """A token ``decode(skip_special_tokens=True)`` leaves out: control, unknown, and the named ones."""
        return self.types[i] in (CONTROL, UNKNOWN) or i in (self.bos_id, self.eos_id, self.unk_id, self.pad_id)


def read_vocab(path: Path) -> GGUFVocab:
    return GGUFVocab.from_metadata(read_metadata(path))


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_metadata(path: Path) -> dict:
    """A GGUF's metadata, every array read (the GGUF specification's layout, versions 2 and 3). Its own reader
    over Python's mmap: lmport.weights.gguf_header's numpy view costs microseconds a string, seconds for a
    vocabulary and its merges. ValueError for a file that is not a GGUF or ends inside its metadata."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        try:
            return _metadata(blob)
        except (struct.error, UnicodeDecodeError, MemoryError, OverflowError) as exc:
            raise ValueError(f"{path}: its GGUF metadata cannot be read ({exc}): the file is damaged") from None


def _metadata(blob) -> dict:
    if blob[:4] != b"GGUF" or struct.unpack_from("<I", blob, 4)[0] not in (2, 3):
        raise ValueError("not a GGUF file of version 2 or 3")
    (count,) = struct.unpack_from("<Q", blob, 16)
    pos, meta = 24, {}
    for _ in range(count):
        (key,), pos = _strings(blob, pos, 1)
        (kind,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        if kind in _SCALARS:
            (meta[key],) = struct.unpack_from(_SCALARS[kind], blob, pos)
            pos += struct.calcsize(_SCALARS[kind])
        elif kind == 8:
            (meta[key],), pos = _strings(blob, pos, 1)
        elif kind == 9:
            element, n = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            if element in _SCALARS:
                width = struct.calcsize(_SCALARS[element])
                if pos + n * width > len(blob):
                    raise struct.error(f"{key} runs past the end of the file")
                meta[key] = list(struct.unpack_from(f"<{n}{_SCALARS[element][1]}", blob, pos))
                pos += n * width
            elif element == 8:
                meta[key], pos = _strings(blob, pos, n)
            else:
                raise ValueError(f"metadata {key!r} is an array of GGUF type {element}")
        else:
            raise ValueError(f"metadata {key!r} has GGUF type {kind}")
    return meta


_LENGTH = struct.Struct("<Q")


def _strings(blob, pos: int, count: int) -> tuple[list[str], int]:
    """``count`` GGUF strings from ``pos`` (each a little-endian u64 length, then its bytes) and the position after
    them: a vocabulary holds hundreds of thousands, so the loop makes no call a string beyond its length's."""
    length, raw = _LENGTH.unpack_from, []
    for _ in range(count):
        (n,) = length(blob, pos)
        raw.append(blob[pos + 8:pos + 8 + n])
        pos += 8 + n
    if pos > len(blob):
        raise struct.error("a string runs past the end of the file")
    return [text.decode("utf-8", errors="replace") for text in raw], pos


def build_tokenizer(vocab: GGUFVocab):
    """The ``tokenizers.Tokenizer`` that splits text as llama.cpp's ``llama_tokenize(add_special=False,
    parse_special=True)`` does (the BOS / EOS that ``add_special`` adds are the wrapper's post-processor)."""
    from tokenizers import AddedToken, Tokenizer
    ids = {t: i for i, t in enumerate(vocab.tokens)}   # a repeated text: llama.cpp keeps the last id
    tok = Tokenizer(_bpe_model(vocab, ids) if vocab.model == "gpt2" else _spm_model(vocab, ids))
    if vocab.model == "gpt2":
        _byte_level(tok, vocab)
    else:
        _sentencepiece(tok, vocab)
    # llama.cpp strips the whitespace after these models' special tokens (its per-token attributes by name)
    phi3 = any(s in vocab.name.lower() for s in ("phi-3", "phi3"))
    never_rstrip = {"<unk>", "<s>", "<|endoftext|>"}
    added = []
    for i, text in enumerate(vocab.tokens):
        if vocab.matched_first(i) or (phi3 and text == "</s>"):
            rstrip = phi3 and text not in never_rstrip
            added.append(AddedToken(text, special=vocab.special(i), normalized=False, rstrip=rstrip))
    tok.add_tokens([t for t in added if not t.special])
    tok.add_special_tokens([t for t in added if t.special])
    if tok.get_vocab_size() != len(vocab.tokens):
        raise AssertionError(f"the tokenizer has {tok.get_vocab_size()} tokens, the file {len(vocab.tokens)}")
    return tok


def _bpe_model(vocab: GGUFVocab, ids: dict[str, int]):
    from tokenizers import models
    # llama.cpp splits a merge at the first space after its first character, and keeps a repeated pair's first
    # rank (dict.fromkeys keeps first occurrences in order); tokenizers refuses a pair whose parts or product are
    # not tokens (a converted file has none; a cut vocabulary has)
    split = dict.fromkeys((merge[:cut], merge[cut + 1:]) for merge in vocab.merges if (cut := merge.find(" ", 1)) > 0)
    pairs = [(a, b) for a, b in split if a in ids and b in ids and a + b in ids]
    ignore_merges = _PRE_TYPES[PRE_TOKENIZERS[vocab.pre]][1]
    return models.BPE(vocab=ids, merges=pairs, ignore_merges=ignore_merges)


def _byte_level(tok, vocab: GGUFVocab) -> None:
    from tokenizers import Regex, decoders, pre_tokenizers
    regexes = _PRE_TYPES[PRE_TOKENIZERS[vocab.pre]][0]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()


def _spm_model(vocab: GGUFVocab, ids: dict[str, int]):
    """SentencePiece's merging as BPE: llama.cpp merges the adjacent pair whose joined text is the
    highest-scoring token (the leftmost among equals), so every split of a token into two tokens is a merge,
    ranked by the joined token's score."""
    from tokenizers import models
    by_score = sorted(range(len(vocab.tokens)), key=lambda i: (-vocab.scores[i], i))
    pairs = []
    for i in by_score:
        text = vocab.tokens[i]
        if vocab.types[i] == BYTE:
            continue
        for cut in range(1, len(text)):
            if text[:cut] in ids and text[cut:] in ids:
                pairs.append((text[:cut], text[cut:]))
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    return models.BPE(vocab=ids, merges=pairs, unk_token=unk, byte_fallback=True, fuse_unk=False)


def _sentencepiece(tok, vocab: GGUFVocab) -> None:
    from tokenizers import decoders, normalizers
    steps = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else [])])


def gguf_tokenizer(path: Path) -> Any:   # transformers types its special-token ids loosely
    """A transformers tokenizer (``TokenizersBackend``) over ``build_tokenizer`` of the file's metadata:
    its BOS / EOS added as ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say, its chat template."""
    from transformers import TokenizersBackend
    vocab = read_vocab(path)

    def named(i: int | None) -> str | None:
        return vocab.tokens[i] if i is not None else None

    return TokenizersBackend(
        tokenizer_object=build_tokenizer(vocab), bos_token=named(vocab.bos_id), eos_token=named(vocab.eos_id),
        unk_token=named(vocab.unk_id), pad_token=named(vocab.pad_id), add_bos_token=vocab.add_bos,
        add_eos_token=vocab.add_eos, chat_template=vocab.chat_template, clean_up_tokenization_spaces=False)
