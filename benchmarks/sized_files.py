"""Random-weight GGUF files in the shapes of the models people run on CPUs, with their real vocabularies, made
as llama.cpp's users make theirs: an F16 file (written here by gguf's writer), then `llama-quantize F16 OUT TYPE`.

Shapes: Llama-3.2-3B, Qwen2.5-7B and Llama-3.1-8B (layers, widths, heads, vocabulary size and tied or separate
output as in their published configs). The tokenizer keys come from llama.cpp's own vocabulary files
(``models/ggml-vocab-*.gguf`` in its source: Llama 3's and Qwen2's), padded with ``[PAD<id>]`` tokens to the
model's embedding rows as llama.cpp's converter pads Qwen2.5's. What decides speed is the same as in the real
files: every tensor's shape and type, the vocabulary's size. Left out: Llama 3's rope-scaling frequencies
(a per-dimension factor: no cost of its own).

A file is named ``SHAPE-TYPE`` (``qwen2.5-7b-Q4_K_M``) and made once into the files directory (the F16 file is
removed after, unless asked to keep it: 6-16 GB).

Run: python benchmarks/sized_files.py qwen2.5-7b-Q4_K_M [llama-3.2-3b-Q4_K_M ...] [--files-dir DIR]
"""
from __future__ import annotations

import argparse
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_DIR = Path.home() / ".cache" / "lmport-files"
DEFAULT_LLAMA_BIN = Path(os.environ.get("LMPORT_LLAMA_CPP_BIN", Path.home() / ".cache" / "llamacpp" / "build" / "bin"))
DEFAULT_LLAMA_SRC = Path(os.environ.get("LMPORT_LLAMA_CPP_SRC", Path.home() / ".cache" / "llamacpp" / "src"))
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


@dataclass(frozen=True)
class Shape:
    arch: str           # GGUF general.architecture
    vocab_file: str     # llama.cpp's models/ggml-vocab-*.gguf
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    n_vocab: int        # embedding rows
    tied: bool          # output projection shares the embedding
    qkv_bias: bool
    rope_theta: float
    rms_eps: float


SHAPES = {
    "llama-3.2-3b": Shape("llama", "ggml-vocab-llama-bpe.gguf", 28, 3072, 8192, 24, 8, 128256, True, False,
                          500000.0, 1e-5),
    "qwen2.5-7b": Shape("qwen2", "ggml-vocab-qwen2.gguf", 28, 3584, 18944, 28, 4, 152064, False, True,
                        1000000.0, 1e-6),
    "llama-3.1-8b": Shape("llama", "ggml-vocab-llama-bpe.gguf", 32, 4096, 14336, 32, 8, 128256, False, False,
                          500000.0, 1e-5),
}
NAMES = tuple(f"{shape}-{kind}" for shape in SHAPES for kind in TYPES)


def split_name(name: str) -> tuple[str, str]:
    """``SHAPE-TYPE`` as (shape, type); a clear error for anything else."""
    for shape in SHAPES:
        kind = name.removeprefix(f"{shape}-")
        if kind != name and kind in TYPES:
            return shape, kind
    raise SystemExit(f"unknown sized file {name!r}: SHAPE-TYPE with SHAPE one of {', '.join(SHAPES)} and TYPE one "
                     f"of {', '.join(TYPES)}")


def tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's GGUF name and (rows, columns) shape, in llama.cpp's order."""
    head_dim = shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    out = [("token_embd.weight", (shape.n_vocab, shape.hidden)), ("output_norm.weight", (shape.hidden,))]
    if not shape.tied:
        out.append(("output.weight", (shape.n_vocab, shape.hidden)))
    for i in range(shape.layers):
        block = [("attn_norm.weight", (shape.hidden,)), ("attn_q.weight", (q, shape.hidden)),
                 ("attn_k.weight", (kv, shape.hidden)), ("attn_v.weight", (kv, shape.hidden)),
                 ("attn_output.weight", (shape.hidden, q)), ("ffn_norm.weight", (shape.hidden,)),
                 ("ffn_gate.weight", (shape.ffn, shape.hidden)), ("ffn_up.weight", (shape.ffn, shape.hidden)),
                 ("ffn_down.weight", (shape.hidden, shape.ffn))]
        if shape.qkv_bias:
            block += [("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))]
        out += [(f"blk.{i}.{name}", dims) for name, dims in block]
    return out


def tokenizer_fields(vocab: Path, n_vocab: int):
    """The vocabulary file's ``tokenizer.*`` keys as (key, value, type, element type), its token list padded to
    ``n_vocab`` with unused ``[PAD<id>]`` tokens."""
    import gguf
    reader = gguf.GGUFReader(vocab)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        element = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), n_vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [gguf.TokenType.UNUSED] * (n_vocab - len(value))
        fields.append((key, value, kind, element))
    return fields


def write_f16(shape: Shape, vocab: Path, out: Path, seed: int = 0) -> None:
    """The F16 file, written tensor by tensor (never more than one in memory): normal weights of scale 0.02
    drawn once into a pool and read from it at a random offset per tensor, norms one, biases zero."""
    import gguf
    writer = gguf.GGUFWriter(out, shape.arch)
    writer.add_name(f"{out.stem} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.n_vocab)
    for key, value, kind, element in tokenizer_fields(vocab, shape.n_vocab):
        writer.add_key_value(key, value, kind, sub_type=element)
    table = tensors(shape)
    for name, dims in table:
        dtype = np.float16 if len(dims) == 2 else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 26, dtype=np.float32) * 0.02).astype(np.float16)
    for name, dims in table:
        if len(dims) == 1:
            writer.write_tensor_data(np.full(dims, 0.0 if name.endswith(".bias") else 1.0, np.float32))
            continue
        n = int(np.prod(dims))
        start = int(rng.integers(len(pool)))
        flat = np.resize(np.roll(pool, -start), n)   # the pool from `start`, repeated to n values
        writer.write_tensor_data(flat.reshape(dims))
    writer.close()


def sized_file(name: str, files_dir: Path = DEFAULT_DIR, llama_bin: Path = DEFAULT_LLAMA_BIN,
               llama_src: Path = DEFAULT_LLAMA_SRC, keep_f16: bool = False) -> Path:
    """``files_dir/NAME.gguf``, made when missing: the shape's F16 file, then llama-quantize to the type."""
    shape_name, kind = split_name(name)
    target = files_dir / f"{name}.gguf"
    if target.exists():
        return target
    quantize, vocab = llama_bin / "llama-quantize", llama_src / "models" / SHAPES[shape_name].vocab_file
    if not quantize.exists():
        raise SystemExit(f"{target} is missing and there is no {quantize} to make it with: pass --llama-bin")
    if not vocab.exists():
        raise SystemExit(f"no {vocab}: pass --llama-src, llama.cpp's source directory (its models/ holds it)")
    files_dir.mkdir(parents=True, exist_ok=True)
    f16 = files_dir / f"{shape_name}-F16.gguf"
    if not f16.exists():
        partial = f16.with_name(f"{f16.stem}.partial.gguf")
        write_f16(SHAPES[shape_name], vocab, partial)
        partial.rename(f16)
    partial = target.with_name(f"{target.stem}.partial.gguf")
    subprocess.run([str(quantize), str(f16), str(partial), kind], check=True, capture_output=True)
    partial.rename(target)
    if not keep_f16:
        f16.unlink()
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+", choices=NAMES, metavar="SHAPE-TYPE", help=", ".join(NAMES))
    ap.add_argument("--files-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN, help="a llama.cpp build's bin directory")
    ap.add_argument("--llama-src", type=Path, default=DEFAULT_LLAMA_SRC, help="llama.cpp's source directory")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 file (to quantize other types from it)")
    args = ap.parse_args()
    for i, name in enumerate(args.names):
        later_shapes = {split_name(later)[0] for later in args.names[i + 1:]}
        keep = args.keep_f16 or split_name(name)[0] in later_shapes
        print(sized_file(name, args.files_dir, args.llama_bin, args.llama_src, keep))


if __name__ == "__main__":
    main()
