"""sentence-transformers models over the test models, saved as directories lmport loads like any other
(the Transformer module at the root, so the directory is also the transformers model)."""
from __future__ import annotations

import functools
import json
import os
import shutil

from support.model_helpers import tiny_model_dir


@functools.cache
def st_model_dir(base: str, pooling: str, normalize: bool) -> str:
    """``base`` (a transformers directory) with a Pooling module ("mean" or "lasttoken") and, if asked, Normalize."""
    from sentence_transformers import SentenceTransformer, models

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / f"st-{os.path.basename(base)}-{pooling}-{'norm' if normalize else 'raw'}-v3"
    if not (target / "modules.json").exists():
        transformer = models.Transformer(base)
        modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
        if normalize:
            modules.append(models.Normalize())
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        SentenceTransformer(modules=modules, device="cpu").save(str(tmp))
        # sentence-transformers 6 reads a text as a chat message (wrapped in the tokenizer's chat template) when
        # the model takes messages; an embedding model embeds the text itself, as lmport does: text only.
        config = json.loads((tmp / "sentence_bert_config.json").read_text())
        config["modality_config"].pop("message", None)
        (tmp / "sentence_bert_config.json").write_text(json.dumps(config))
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def tiny_st_dir(pooling: str, normalize: bool) -> str:
    return st_model_dir(tiny_model_dir("llama"), pooling, normalize)


@functools.cache
def st_model(path: str):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(path, device="cpu")
