"""Each test worker reads a tokenizer from disk once and hands out copies.

The suite builds hundreds of engines from a dozen tiny model directories and GGUF files, and reading a
tokenizer is most of building a tiny engine: transformers parses a directory's tokenizer.json in Python,
lmport builds a GGUF's vocabulary and merges into a ``tokenizers`` model. A deep copy of one already read is a
fraction of that and shares nothing with it, so a test that changes its tokenizer (a chat template, say)
changes only its own. The key holds every file's size and modification time, so a file a test rewrites is read
again; a read that fails is not kept, and raises again next time.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path


def _stamp(path: Path) -> tuple:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return tuple((f.name, s.st_size, s.st_mtime_ns) for f in files if f.is_file() and (s := f.stat()))


def _memoized(read):
    @functools.lru_cache(maxsize=32)
    def first_read(path: Path, stamp: tuple, kwargs: tuple):
        return read(path, **dict(kwargs))

    @functools.wraps(read)
    def copy_of_first_read(path, *args, **kwargs):
        local = Path(path) if isinstance(path, (str, Path)) else None
        if args or local is None or not local.exists():
            return read(path, *args, **kwargs)
        try:
            key = (local.resolve(), _stamp(local), tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:   # an argument that cannot be a key: read it as asked
            return read(path, **kwargs)
        return copy.deepcopy(first_read(*key))

    return copy_of_first_read


def install() -> None:
    """From now on in this process, transformers' ``AutoTokenizer.from_pretrained`` of a local directory and
    lmport's GGUF tokenizer read each file once."""
    import transformers

    import lmport.weights.gguf_tokenizer as gguf_tokenizer
    from_pretrained = transformers.AutoTokenizer.from_pretrained
    transformers.AutoTokenizer.from_pretrained = _memoized(from_pretrained)
    gguf_tokenizer.gguf_tokenizer = _memoized(gguf_tokenizer.gguf_tokenizer)
