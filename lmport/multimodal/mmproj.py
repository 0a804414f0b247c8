"""A vision-language model from two GGUF files, as llama.cpp runs one: the text model and the ``mmproj`` file
(``convert_hf_to_gguf.py --mmproj``) holding the vision tower and its projector.

The text GGUF loads as any GGUF does (lmport.weights.gguf; Qwen2.5-VL's is architecture ``qwen2vl``, whose config
is Qwen2's with the multimodal rotary's sections in ``rope.dimension_sections``). The mmproj file gives:

- the vision config, from its ``clip.vision.*`` keys, with what the converter does not store taken as llama.cpp's
  mtmd takes it (Qwen2.5-VL: a 2 x 2 merge, two frames a patch, a window of 112 pixels, a full-attention block
  every ``n_wa_pattern`` blocks);
- the vision tower: transformers' own modules built from that config, holding the file's tensors under
  transformers' names (llama.cpp's renaming undone; Qwen2.5-VL's q, k and v joined back into ``qkv``, the two frames
  of its patch embedding stacked back into one 3-D convolution). F32, F16 and BF16 tensors load in the compute
  dtype; a quantized one (an mmproj made with ``--outtype q8_0``) is dequantized to it: the tower runs in float;
- the image preprocessing: transformers' image processor of the family built with the file's sizes, mean and
  standard deviation (Qwen2.5-VL: the pixel limits from ``clip.vision.image_min_pixels`` / ``image_max_pixels``
  where the file has them, else llama.cpp's, 8 to 4096 tokens; Idefics3: the longest side from
  ``clip.vision.preproc_image_size``, tiles of ``clip.vision.image_size``).

The placeholder tokens come from the text GGUF's vocabulary by their text (``<|image_pad|>``, ``<image>``, ...), where
a transformers directory's config names their ids. SmolVLM / Idefics3's text model is a ``llama`` GGUF (its Llama
decoder converted alone, as llama.cpp's SmolVLM files are).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmport.errors import ConfigError
from lmport.weights import gguf
from lmport.weights.gguf_header import GGUFHeader, TensorInfo, read_header


@dataclass(frozen=True)
class Projector:
    """What lmport knows of one ``clip.projector_type``: the family, the text GGUF architectures it pairs with and
    the transformers model type lmport runs the pair as."""
    family: str
    text_architectures: tuple[str, ...]
    model_type: str


PROJECTORS = {"qwen2.5vl_merger": Projector("Qwen2.5-VL", ("qwen2vl",), "qwen2_5_vl"),
              "idefics3": Projector("SmolVLM / Idefics3", ("llama",), "idefics3")}
# Qwen2.5-VL's placeholder tokens: config field -> the token's text in the vocabulary.
_QWEN2_VL_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                    "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
_MERGE_SIZE, _TEMPORAL_PATCH = 2, 2   # llama.cpp's for Qwen2.5-VL (the converter asserts two frames a patch)
# llama.cpp's for Qwen2.5-VL where the file is silent (clip.cpp): images of 8 to 4096 tokens, a 112-pixel window
_QWEN2_VL_TOKEN_LIMITS, _QWEN2_VL_WINDOW = (8, 4096), 112


def _supported() -> str:
    return ", ".join(f"{name} ({p.family}, with a {'/'.join(p.text_architectures)} text model)"
                     for name, p in PROJECTORS.items())


def read_mmproj(path: Path) -> GGUFHeader:
    """The mmproj file's header; ConfigError unless it is a GGUF mmproj of a vision tower lmport runs."""
    if not path.is_file():
        raise ConfigError(f"mmproj {str(path)!r} is not a file: give the mmproj GGUF that llama.cpp's "
                          f"convert_hf_to_gguf.py --mmproj wrote for the model")
    header = _header(path, path.stat().st_mtime_ns)
    meta = header.metadata
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder", False):
        raise ConfigError(f"{path.name} is not an mmproj file with a vision encoder (general.architecture "
                          f"{meta.get('general.architecture')!r}); give the file convert_hf_to_gguf.py --mmproj "
                          f"wrote, not a text model")
    projector = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if projector not in PROJECTORS:
        raise ConfigError(f"{path.name}: its vision projector {projector!r} is not one lmport runs from an mmproj "
                          f"file; it runs {_supported()}")
    return header


@functools.lru_cache(maxsize=4)
def _header(path: Path, mtime_ns: int) -> GGUFHeader:
    try:
        return read_header(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{path.name} is not a readable GGUF file: {exc}") from None


def projector_of(header: GGUFHeader) -> Projector:
    meta = header.metadata
    return PROJECTORS[meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))]


def check_pair(model: Path, mmproj: Path) -> Projector:
    """ConfigError unless ``model`` is a GGUF text model that ``mmproj`` is the vision tower of: the text
    architecture one the projector pairs with, and the projector's output as wide as the text model's embedding."""
    if model.suffix != ".gguf" or not model.is_file():
        raise ConfigError(f"--mmproj goes with a GGUF text model; {model.name} is a transformers directory, which "
                          f"holds its own vision tower: serve it without --mmproj")
    header = read_mmproj(mmproj)
    projector = projector_of(header)
    text = gguf.read(model).metadata
    arch = text.get("general.architecture")
    if arch not in projector.text_architectures:
        what = ("a text-only model" if arch not in {a for p in PROJECTORS.values() for a in p.text_architectures}
                else "another family's text model")
        raise ConfigError(f"{model.name} (GGUF architecture {arch!r}) is {what}: {mmproj.name} is a {projector.family} "
                          f"vision tower, which goes with a {'/'.join(projector.text_architectures)} text model. "
                          f"lmport runs mmproj files of {_supported()}")
    width, projected = text.get(f"{arch}.embedding_length"), header.metadata.get("clip.vision.projection_dim")
    if width != projected:
        raise ConfigError(f"{mmproj.name} does not belong to {model.name}: its vision tower gives embeddings of "
                          f"{projected} values, the text model's are {width} wide; give the mmproj file converted "
                          f"from the same checkpoint as the text model")
    return projector


def model_config(model: Path, mmproj: Path, text_cfg):
    """lmport's config of the pair: the vision-language checkpoint's config (transformers' class) made of the text
    GGUF's config (``text_cfg``) and the mmproj's vision config, read as lmport reads that checkpoint's."""
    from lmport.models.architectures import lmport_config
    return lmport_config(checkpoint_config(model, mmproj, text_cfg))


def checkpoint_config(model: Path, mmproj: Path, text_cfg=None):
    """transformers' config of the checkpoint the pair was converted from (Qwen2_5_VLConfig, Idefics3Config), as far
    as the files tell it; ``text_cfg``: the text GGUF's config (read from it when not given)."""
    projector = check_pair(model, mmproj)
    text_cfg = text_cfg if text_cfg is not None else gguf.transformers_config(model)
    if projector.model_type == "idefics3":
        return _idefics3_config(model, read_mmproj(mmproj).metadata, text_cfg)
    return _qwen2_5_vl_config(model, read_mmproj(mmproj).metadata, text_cfg)


_TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id")


def _idefics3_config(model: Path, meta: dict, text_cfg):
    """Idefics3's: its Llama text config (the text GGUF's), the SigLIP tower's from the mmproj, the connector's
    pixel shuffle (``projector.scale_factor``) and ``<image>``'s id."""
    from transformers import Idefics3Config
    text = {k: getattr(text_cfg, k) for k in (*_TEXT_FIELDS, "rope_parameters", "head_dim", "attention_bias",
                                              "mlp_bias")}
    vision = {"hidden_size": meta["clip.vision.embedding_length"],
              "intermediate_size": meta["clip.vision.feed_forward_length"],
              "num_hidden_layers": meta["clip.vision.block_count"],
              "num_attention_heads": meta["clip.vision.attention.head_count"],
              "image_size": meta["clip.vision.image_size"], "patch_size": meta["clip.vision.patch_size"],
              "layer_norm_eps": meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)}
    return Idefics3Config(text_config=text | {"model_type": "llama"}, vision_config=vision,
                          scale_factor=meta.get("clip.vision.projector.scale_factor", 2),
                          tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                          **placeholder_ids(model, {"image_token_id": "<image>"}))


def _qwen2_5_vl_config(model: Path, meta: dict, text_cfg):
    """Qwen2.5-VL's: its Qwen2 text config (the text GGUF's) with the multimodal rotary's sections, the vision
    tower's from the mmproj (with llama.cpp's assumptions), the placeholder tokens' ids."""
    from transformers import Qwen2_5_VLConfig
    text_meta = gguf.read(model).metadata
    arch = text_meta["general.architecture"]
    sections = list(text_meta.get(f"{arch}.rope.dimension_sections", []))[:3]
    if len(sections) != 3 or not any(sections):
        raise ConfigError(f"{model.name}: no {arch}.rope.dimension_sections (the multimodal rotary's sections); the "
                          f"file was not written by llama.cpp's converter from a Qwen2.5-VL checkpoint")
    rope = dict(text_cfg.rope_parameters or {}) | {"mrope_section": sections}
    text = {k: getattr(text_cfg, k) for k in _TEXT_FIELDS}
    patch = meta["clip.vision.patch_size"]
    blocks = meta["clip.vision.block_count"]
    pattern = meta.get("clip.vision.n_wa_pattern", 0)
    # llama.cpp's window pattern: block i attends over the whole image where (i + 1) % n_wa_pattern == 0
    full = [i for i in range(blocks) if pattern and (i + 1) % pattern == 0] if pattern else list(range(blocks))
    vision = {"depth": blocks, "hidden_size": meta["clip.vision.embedding_length"],
              "intermediate_size": meta["clip.vision.feed_forward_length"],
              "num_heads": meta["clip.vision.attention.head_count"],
              "out_hidden_size": meta["clip.vision.projection_dim"], "patch_size": patch,
              "spatial_merge_size": meta.get("clip.vision.spatial_merge_size", _MERGE_SIZE),
              "temporal_patch_size": _TEMPORAL_PATCH, "hidden_act": "silu" if meta.get("clip.use_silu") else "gelu",
              "window_size": meta.get("clip.vision.window_size", _QWEN2_VL_WINDOW),
              "fullatt_block_indexes": full}
    tokens = placeholder_ids(model, _QWEN2_VL_TOKENS)
    return Qwen2_5_VLConfig(text_config=text | {"rope_parameters": rope}, vision_config=vision,
                            tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)), **tokens)


def placeholder_ids(model: Path, tokens: dict[str, str]) -> dict[str, int]:
    """{config field: id} of the placeholder tokens (by their text) in the text GGUF's vocabulary."""
    vocabulary = read_header(model, string_arrays=("tokenizer.ggml.tokens",)).metadata.get("tokenizer.ggml.tokens")
    index = {token: i for i, token in enumerate(vocabulary or [])}
    missing = [text for text in tokens.values() if text not in index]
    if missing:
        raise ConfigError(f"{model.name}: its vocabulary has no {', '.join(missing)}, the tokens a prompt places "
                          f"images with; the text model is not the vision-language one")
    return {field: index[text] for field, text in tokens.items()}


def text_rotary(cfg) -> torch.nn.Module:
    """The text model's rotary module for ``cfg`` (lmport's text view of the pair's config), as a transformers
    directory's model has it: Qwen2.5-VL's multimodal one (the sections in its rope parameters), Idefics3's Llama's."""
    if cfg.model_type == "idefics3":
        from lmport.models.rotary import LlamaRotary
        return LlamaRotary(cfg)
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    return Qwen2_5_VLRotaryEmbedding(config=cfg)


def attach(paged: torch.nn.Module, model: Path, mmproj: Path, dtype: torch.dtype) -> None:
    """Give ``paged`` (the text model built from the pair's config) the mmproj's vision modules, under the names its
    model class runs them by (lmport.models.qwen2_vl, lmport.models.idefics3)."""
    config = checkpoint_config(model, mmproj)
    if config.model_type == "idefics3":
        paged.vision_model, paged.connector = idefics3_modules(mmproj, config, dtype)
    else:
        paged.visual = vision_tower(mmproj, config.vision_config, dtype)


def idefics3_modules(mmproj: Path, config, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' Idefics3 SigLIP tower and pixel-shuffle connector holding the mmproj's tensors in ``dtype``."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer
    header = read_mmproj(mmproj)
    with torch.device("meta"):
        vision = Idefics3VisionTransformer._from_config(config.vision_config, dtype=dtype)
        connector = Idefics3Connector(config)
    names = [f"model.vision_model.{n}" for n in vision.state_dict()] + [
        f"model.connector.{n}" for n in connector.state_dict()]
    state = transformers_tensors(header, dtype, names)
    vision.load_state_dict({k.removeprefix("model.vision_model."): v for k, v in state.items()
                            if k.startswith("model.vision_model.")}, strict=True, assign=True)
    connector.load_state_dict({k.removeprefix("model.connector."): v for k, v in state.items()
                               if k.startswith("model.connector.")}, strict=True, assign=True)
    return vision.eval(), connector.eval()


def vision_tower(mmproj: Path, vision_config, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Qwen2.5-VL vision tower (patch embedding, vision blocks, patch merger) holding the mmproj's
    tensors in ``dtype``; ValueError naming a tensor the file lacks or one without a place in the tower."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    header = read_mmproj(mmproj)
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config, dtype=dtype)
    state = transformers_tensors(header, dtype, [f"visual.{n}" for n in tower.state_dict()])
    tower.load_state_dict({k.removeprefix("visual."): v for k, v in state.items()}, strict=True, assign=True)
    # the rotary's frequencies are computed, not stored: made again off the meta device
    tower.rotary_pos_emb = type(tower.rotary_pos_emb)(tower.config)
    return tower.eval()


def transformers_tensors(header: GGUFHeader, dtype: torch.dtype, names: list[str]) -> dict[str, torch.Tensor]:
    """The mmproj's tensors under the vision modules' parameter names ``names`` (transformers' checkpoint names:
    ``visual.`` for Qwen2.5-VL's tower, ``model.vision_model.`` and ``model.connector.`` for Idefics3's), undoing the
    converter's renaming and splits; ValueError for a tensor the file lacks or one left over."""
    import gguf as gguf_py
    tensors = {t.name: t for t in header.tensors}
    name_map = gguf_py.get_tensor_name_map(gguf_py.MODEL_ARCH.MMPROJ, header.metadata["clip.vision.block_count"])
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{header.path.name}: no tensor {name!r} (the vision tower's); the file is not a complete "
                             f"mmproj of the model")
        used.add(name)
        return _float(header, tensors[name], dtype)

    state = {}
    for name in names:
        base, _, suffix = name.rpartition(".")
        if name == "visual.patch_embed.proj.weight":   # stored as one 2-D convolution for each of the two frames
            embd = gguf_py.TENSOR_NAMES[gguf_py.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
            state[name] = torch.stack([take(embd), take(embd + ".1")], dim=2)
        elif base.endswith(".attn.qkv"):   # stored split into q, k and v
            parts = [name_map.get_name(f"{base[:-3]}{p}") for p in "qkv"]
            state[name] = torch.cat([take(f"{p}.{suffix}") for p in parts])
        elif (mapped := name_map.get_name(base)) is not None:
            state[name] = take(f"{mapped}.{suffix}")
        else:
            raise ValueError(f"{header.path.name}: the vision tower's {name} has no tensor name in llama.cpp's map")
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"{header.path.name}: tensors {', '.join(unused[:4])} have no place in the "
                         f"{projector_of(header).family} vision tower built from its metadata")
    return state


def _float(header: GGUFHeader, t: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of the file in ``dtype``: float types converted, quantized ones dequantized (gguf's dequantizer)."""
    import gguf as gguf_py
    qtype = gguf_py.GGMLQuantizationType(t.ggml_type)
    data = header.data(t)
    if qtype == gguf_py.GGMLQuantizationType.BF16:
        return torch.from_numpy(np.array(data)).view(torch.bfloat16).to(dtype)
    if qtype in (gguf_py.GGMLQuantizationType.F32, gguf_py.GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(data)).to(dtype)
    try:
        values = gguf_py.quants.dequantize(np.asarray(data), qtype)
    except NotImplementedError:
        raise ConfigError(f"{header.path.name}: tensor {t.name} is {qtype.name}, which gguf cannot dequantize; "
                          f"convert the mmproj with --outtype f16") from None
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).to(dtype).reshape(t.shape)


def image_processor(model: Path, mmproj: Path):
    """The front end's image processor for the pair (lmport.multimodal.processor.ImageProcessor, or the tiled one
    for Idefics3), made of transformers' image processor of the family sized by the mmproj's metadata."""
    projector = check_pair(model, mmproj)
    meta = read_mmproj(mmproj).metadata
    if projector.model_type == "idefics3":
        return _tiled_image_processor(model, meta)
    from transformers import Qwen2VLImageProcessorPil

    from lmport.multimodal.processor import ImageProcessor
    patch = meta["clip.vision.patch_size"]
    merge = meta.get("clip.vision.spatial_merge_size", _MERGE_SIZE)
    cell = (patch * merge) ** 2   # the pixels of one token
    low, high = _QWEN2_VL_TOKEN_LIMITS
    size = {"shortest_edge": meta.get("clip.vision.image_min_pixels", low * cell),
            "longest_edge": meta.get("clip.vision.image_max_pixels", high * cell)}
    images = Qwen2VLImageProcessorPil(size=size, patch_size=patch, temporal_patch_size=_TEMPORAL_PATCH,
                                      merge_size=merge, image_mean=list(meta["clip.vision.image_mean"]),
                                      image_std=list(meta["clip.vision.image_std"]))
    return ImageProcessor(images, placeholder_ids(model, {"image": _QWEN2_VL_TOKENS["image_token_id"]})["image"], merge)


def _tiled_image_processor(model: Path, meta: dict):
    """Idefics3's: transformers' Idefics3Processor over the text GGUF's tokenizer and Idefics3's image processor (its
    PIL one) resizing to ``preproc_image_size`` and cutting tiles of ``image_size``."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    from lmport.multimodal.tiles import TiledImageProcessor
    from lmport.weights.gguf_tokenizer import gguf_tokenizer
    tile, patch = meta["clip.vision.image_size"], meta["clip.vision.patch_size"]
    scale = meta.get("clip.vision.projector.scale_factor", 2)
    images = Idefics3ImageProcessorPil(size={"longest_edge": meta.get("clip.vision.preproc_image_size", tile)},
                                       max_image_size={"longest_edge": tile},
                                       image_mean=list(meta["clip.vision.image_mean"]),
                                       image_std=list(meta["clip.vision.image_std"]))
    processor = Idefics3Processor(images, gguf_tokenizer(model), image_seq_len=(tile // patch) ** 2 // scale ** 2)
    return TiledImageProcessor(processor, patch)
