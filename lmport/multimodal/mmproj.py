"""A vision-language model from two GGUF files, as llama.cpp runs one: the text model and the ``mmproj`` file
(``convert_hf_to_gguf.py --mmproj``) holding the vision tower and its projector.

The text GGUF loads as any GGUF does (lmport.weights.gguf; Qwen2.5-VL's is architecture ``qwen2vl``, whose config
is Qwen2's with the multimodal rotary's sections in ``rope.dimension_sections``; Qwen3-VL's ``qwen3vl``, Qwen3's
with them; Gemma 3's ``gemma3``; Mistral 3's ``mistral3``, Mistral's; Llama 4's ``llama4``). The mmproj file gives:

- the vision config, from its ``clip.vision.*`` keys, with what the converter does not store taken as llama.cpp's
  mtmd takes it (Qwen2.5-VL: a 2 x 2 merge, two frames a patch, a window of 112 pixels, a full-attention block
  every ``n_wa_pattern`` blocks; Qwen3-VL: the deepstack blocks from ``is_deepstack_layers``, the learned position
  grid from its tensor; Gemma 3: the projector's pooling, ``projector.scale_factor`` or 4, and the attention scale
  llama.cpp uses, one over the square root of the head size, 27B's of the width over the heads; Pixtral: a 2D
  rotary of base 10000, the projector's activation GELU; Llama 4: a 2D rotary of base 10000, the pixel shuffle's
  ratio from ``projector.scale_factor``, the adapter's and projector's widths from their tensors);
- the vision tower: transformers' own modules built from that config, holding the file's tensors under
  transformers' names (llama.cpp's renaming undone; Qwen2.5-VL's q, k and v joined back into ``qkv``, the two frames
  of Qwen's patch embedding stacked back into one 3-D convolution, Pixtral's q and k rows put back in the order
  its rotary takes, Gemma 3's soft-embedding norm stored as ``1 + w`` taken back to ``w``, Llama 4's class token,
  position table and one-layer projector under their own names). F32, F16 and BF16
  tensors load in the compute
  dtype; a quantized one (an mmproj made with ``--outtype q8_0``) is dequantized to it: the tower runs in float;
- the image preprocessing: transformers' image processor of the family built with the file's sizes, mean and
  standard deviation (Qwen2.5-VL: the pixel limits from ``clip.vision.image_min_pixels`` / ``image_max_pixels``
  where the file has them, else llama.cpp's, 8 to 4096 tokens; Idefics3: the longest side from
  ``clip.vision.preproc_image_size``, tiles of ``clip.vision.image_size``; Llama 4: tiles of ``image_size``, at
  most ``LLAMA4_MAX_TILES`` an image, laid out as transformers' ``Llama4Processor`` does).

The placeholder tokens come from the text GGUF's vocabulary by their text (``<|image_pad|>``, ``<image>``,
``<start_of_image>``, ``[IMG]``, ...), where
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
              "qwen3vl_merger": Projector("Qwen3-VL", ("qwen3vl",), "qwen3_vl"),
              "gemma3": Projector("Gemma 3", ("gemma3",), "gemma3"),
              "pixtral": Projector("Mistral 3 / Pixtral", ("mistral3",), "mistral3"),
              "idefics3": Projector("SmolVLM / Idefics3", ("llama",), "idefics3"),
              "llama4": Projector("Llama 4", ("llama4",), "llama4")}
# Qwen2.5-VL's placeholder tokens: config field -> the token's text in the vocabulary.
_QWEN2_VL_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                    "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
_MERGE_SIZE, _TEMPORAL_PATCH = 2, 2   # llama.cpp's for Qwen2.5-VL (the converter asserts two frames a patch)
# llama.cpp's for Qwen2.5-VL where the file is silent (clip.cpp): images of 8 to 4096 tokens, a 112-pixel window
_QWEN2_VL_TOKEN_LIMITS, _QWEN2_VL_WINDOW = (8, 4096), 112
# Gemma 3's image tokens: config field -> the token's text; llama.cpp's pooling (patches a side over tokens a side)
_GEMMA3_TOKENS = {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                  "image_token_index": "<image_soft_token>"}
_GEMMA3_POOLING, _GEMMA3_27B_LAYERS = 4, 62
# Pixtral's tokens: the image token, the end of a row and of the image
_PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
# Llama 4's image tokens: config field -> the token's text (``<|patch|>`` takes the vision rows); what llama.cpp's
# mtmd assumes of its vision model (clip.cpp): a 2D rotary of base 10000, a pixel shuffle of 2 where the file is
# silent; and the image processor's tiles an image at most (the file stores none): transformers' default, the
# released checkpoints' ``max_patches``
_LLAMA4_TOKENS = {"image_token_index": "<|patch|>", "boi_token_index": "<|image_start|>",
                  "eoi_token_index": "<|image_end|>"}
_LLAMA4_ROPE_THETA, _LLAMA4_SHUFFLE, LLAMA4_MAX_TILES = 10000.0, 2, 16


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
    build = {"idefics3": _idefics3_config, "qwen2_5_vl": _qwen2_5_vl_config, "qwen3_vl": _qwen3_vl_config,
             "gemma3": _gemma3_config, "mistral3": _mistral3_config, "llama4": _llama4_config}[projector.model_type]
    return build(model, read_mmproj(mmproj), text_cfg)


_TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id")


def _vit_sizes(meta: dict) -> dict:
    """The tower's sizes a SigLIP-style (or Llama 4) mmproj states, under transformers' vision config names."""
    return {"hidden_size": meta["clip.vision.embedding_length"],
            "intermediate_size": meta["clip.vision.feed_forward_length"],
            "num_hidden_layers": meta["clip.vision.block_count"],
            "num_attention_heads": meta["clip.vision.attention.head_count"],
            "image_size": meta["clip.vision.image_size"], "patch_size": meta["clip.vision.patch_size"]}


def _idefics3_config(model: Path, header: GGUFHeader, text_cfg):
    """Idefics3's: its Llama text config (the text GGUF's), the SigLIP tower's from the mmproj, the connector's
    pixel shuffle (``projector.scale_factor``) and ``<image>``'s id."""
    meta = header.metadata
    from transformers import Idefics3Config
    text = {k: getattr(text_cfg, k) for k in (*_TEXT_FIELDS, "rope_parameters", "head_dim", "attention_bias",
                                              "mlp_bias")}
    vision = _vit_sizes(meta) | {"layer_norm_eps": meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)}
    return Idefics3Config(text_config=text | {"model_type": "llama"}, vision_config=vision,
                          scale_factor=meta.get("clip.vision.projector.scale_factor", 2),
                          tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                          **placeholder_ids(model, {"image_token_id": "<image>"}))


def _mrope_sections(model: Path, family: str) -> tuple[dict, list[int]]:
    """The text GGUF's metadata and its multimodal rotary's three sections; ConfigError where the file has none."""
    text_meta = gguf.read(model).metadata
    arch = text_meta["general.architecture"]
    sections = list(text_meta.get(f"{arch}.rope.dimension_sections", []))[:3]
    if len(sections) != 3 or not any(sections):
        raise ConfigError(f"{model.name}: no {arch}.rope.dimension_sections (the multimodal rotary's sections); the "
                          f"file was not written by llama.cpp's converter from a {family} checkpoint")
    return text_meta, sections


def _qwen2_5_vl_config(model: Path, header: GGUFHeader, text_cfg):
    """Qwen2.5-VL's: its Qwen2 text config (the text GGUF's) with the multimodal rotary's sections, the vision
    tower's from the mmproj (with llama.cpp's assumptions), the placeholder tokens' ids."""
    meta = header.metadata
    from transformers import Qwen2_5_VLConfig
    _, sections = _mrope_sections(model, "Qwen2.5-VL")
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


def _qwen3_vl_config(model: Path, header: GGUFHeader, text_cfg):
    """Qwen3-VL's: its Qwen3 text config (the text GGUF's) with the interleaved multimodal rotary's sections, the
    vision tower's from the mmproj (its deepstack blocks, its learned position grid's size from the tensor), the
    placeholder tokens' ids."""
    meta = header.metadata
    from transformers import Qwen3VLConfig
    text_meta, sections = _mrope_sections(model, "Qwen3-VL")
    arch = text_meta["general.architecture"]
    rope = dict(text_cfg.rope_parameters or {}) | {"mrope_section": sections, "mrope_interleaved": True}
    text = {k: getattr(text_cfg, k) for k in _TEXT_FIELDS}
    text["head_dim"] = text_meta.get(f"{arch}.attention.key_length", text_cfg.head_dim)   # apart from the width
    positions = next((t.shape[0] for t in header.tensors if t.name == "v.position_embd.weight"), None)
    if positions is None:
        raise ConfigError("the Qwen3-VL mmproj has no v.position_embd.weight (its learned position grid); the file "
                          "is not a complete mmproj of the model")
    deepstack = [i for i, on in enumerate(meta.get("clip.vision.is_deepstack_layers", [])) if on]
    vision = {"depth": meta["clip.vision.block_count"], "hidden_size": meta["clip.vision.embedding_length"],
              "intermediate_size": meta["clip.vision.feed_forward_length"],
              "num_heads": meta["clip.vision.attention.head_count"],
              "out_hidden_size": meta["clip.vision.projection_dim"], "patch_size": meta["clip.vision.patch_size"],
              "spatial_merge_size": meta.get("clip.vision.spatial_merge_size", _MERGE_SIZE),
              "temporal_patch_size": _TEMPORAL_PATCH, "num_position_embeddings": positions,
              # llama.cpp's GELU is the tanh approximation, Qwen3-VL's own
              "hidden_act": "silu" if meta.get("clip.use_silu") else "gelu_pytorch_tanh",
              "deepstack_visual_indexes": deepstack}
    return Qwen3VLConfig(text_config=text | {"rope_parameters": rope}, vision_config=vision,
                         tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                         **placeholder_ids(model, _QWEN2_VL_TOKENS))


def _gemma3_config(model: Path, header: GGUFHeader, text_cfg):
    """Gemma 3's: its text config (the text GGUF's, with the attention scale llama.cpp uses), the SigLIP tower's
    from the mmproj, the tokens an image gives (the patches a side pooled by ``projector.scale_factor``, 4 where
    the file is silent) and the image tokens' ids."""
    meta = header.metadata
    from transformers import Gemma3Config
    text = {k: v for k, v in text_cfg.to_dict().items() if k not in ("model_type", "architectures", "dtype",
                                                                      "transformers_version")}
    # llama.cpp scales attention by 1/sqrt(head size), the 27B (62 layers) by 1/sqrt(width / heads): the file does
    # not store query_pre_attn_scalar
    if text_cfg.num_hidden_layers == _GEMMA3_27B_LAYERS:
        text["query_pre_attn_scalar"] = text_cfg.hidden_size // text_cfg.num_attention_heads
    else:
        text["query_pre_attn_scalar"] = text_cfg.head_dim
    size, patch = meta["clip.vision.image_size"], meta["clip.vision.patch_size"]
    pooling = meta.get("clip.vision.projector.scale_factor", _GEMMA3_POOLING)
    vision = _vit_sizes(meta) | {"layer_norm_eps": meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6),
                                 "vision_use_head": False}
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=(size // patch // pooling) ** 2,
                        tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", True)),
                        **placeholder_ids(model, _GEMMA3_TOKENS))


def _mistral3_config(model: Path, header: GGUFHeader, text_cfg):
    """Mistral 3's: its Mistral text config (the text GGUF's), the Pixtral tower's from the mmproj (llama.cpp's 2D
    rotary base, 10000), the projector's merge size, bias (by its tensors) and GELU, and ``[IMG]``'s id."""
    meta = header.metadata
    from transformers import Mistral3Config
    text = {k: getattr(text_cfg, k) for k in (*_TEXT_FIELDS, "head_dim", "rope_parameters")}
    width, heads = meta["clip.vision.embedding_length"], meta["clip.vision.attention.head_count"]
    vision = {"model_type": "pixtral", "hidden_size": width, "num_attention_heads": heads, "head_dim": width // heads,
              "intermediate_size": meta["clip.vision.feed_forward_length"],
              "num_hidden_layers": meta["clip.vision.block_count"], "image_size": meta["clip.vision.image_size"],
              "patch_size": meta["clip.vision.patch_size"],
              "hidden_act": "silu" if meta.get("clip.use_silu") else "gelu",
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    biased = any(t.name == "mm.1.bias" for t in header.tensors)
    return Mistral3Config(text_config=text | {"model_type": "mistral", "sliding_window": None},
                          vision_config=vision, spatial_merge_size=meta.get("clip.vision.spatial_merge_size", 1),
                          projector_hidden_act="gelu", multimodal_projector_bias=biased, vision_feature_layer=-1,
                          tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                          image_token_index=placeholder_ids(model, {"image": _PIXTRAL_TOKENS[0]})["image"])


def _llama4_config(model: Path, header: GGUFHeader, text_cfg):
    """Llama 4's: its text config (the text GGUF's, with what llama.cpp assumes of a llama4 file), the vision
    model's from the mmproj (the adapter's and projector's widths from their tensors, the pixel shuffle from
    ``projector.scale_factor``, llama.cpp's rotary base) and the image tokens' ids."""
    meta = header.metadata
    from transformers import Llama4Config
    shapes = {t.name: t.shape for t in header.tensors}
    missing = [n for n in ("mm.model.mlp.1.weight", "mm.model.mlp.2.weight", "mm.model.fc.weight") if n not in shapes]
    if missing:
        raise ConfigError(f"{header.path.name}: no {', '.join(missing)} (Llama 4's pixel-shuffle adapter and "
                          f"projector); the file is not a complete mmproj of the model")
    text = {k: v for k, v in text_cfg.to_dict().items() if k not in ("model_type", "architectures", "dtype",
                                                                      "transformers_version")}
    vision = _vit_sizes(meta) | {
        # stored as float32: the config's decimal back
        "norm_eps": float(f"{meta.get('clip.vision.attention.layer_norm_epsilon', 1e-5):.7g}"),
        "pixel_shuffle_ratio": 1.0 / meta.get("clip.vision.projector.scale_factor", _LLAMA4_SHUFFLE),
        "projector_input_dim": shapes["mm.model.mlp.1.weight"][0],
        "projector_output_dim": shapes["mm.model.mlp.2.weight"][0],
        "vision_output_dim": shapes["mm.model.fc.weight"][1],
        "rope_parameters": {"rope_type": "default", "rope_theta": _LLAMA4_ROPE_THETA}}
    return Llama4Config(text_config=text, vision_config=vision,
                        tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                        **placeholder_ids(model, _LLAMA4_TOKENS))


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
    directory's model has it: Qwen's multimodal one (the sections in its rope parameters), Gemma 3's (a base for
    each layer type), Mistral's and Idefics3's Llama's."""
    if cfg.model_type == "idefics3":
        from lmport.models.rotary import LlamaRotary
        return LlamaRotary(cfg)
    if cfg.model_type == "gemma3":
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
        return Gemma3RotaryEmbedding(config=cfg)
    if cfg.model_type == "mistral3":
        from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
        return MistralRotaryEmbedding(config=cfg)
    if cfg.model_type == "llama4":
        from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding
        return Llama4TextRotaryEmbedding(config=cfg)
    if cfg.model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding
        return Qwen3VLTextRotaryEmbedding(config=cfg)
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    return Qwen2_5_VLRotaryEmbedding(config=cfg)


def attach(paged: torch.nn.Module, model: Path, mmproj: Path, dtype: torch.dtype) -> None:
    """Give ``paged`` (the text model built from the pair's config) the mmproj's vision modules, under the names its
    model class runs them by (lmport.models.qwen2_vl, qwen3_vl, idefics3, gemma3_vl, mistral3, llama4_vl)."""
    config = checkpoint_config(model, mmproj)
    if config.model_type == "llama4":
        paged.vision_model, paged.projector = llama4_modules(mmproj, config, dtype)
    elif config.model_type == "idefics3":
        paged.vision_model, paged.connector = idefics3_modules(mmproj, config, dtype)
    elif config.model_type in ("gemma3", "mistral3"):
        paged.vision_tower, paged.projector = tower_and_projector(mmproj, config, dtype)
    else:
        paged.visual = vision_tower(mmproj, config.vision_config, dtype)


def tower_and_projector(mmproj: Path, config, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Gemma 3's SigLIP tower and ``Gemma3MultiModalProjector``, or Mistral 3's Pixtral tower and
    ``Mistral3MultiModalProjector`` (transformers' modules, by ``config``'s model type) holding the mmproj's
    tensors in ``dtype``."""
    from transformers import AutoModel
    if config.model_type == "gemma3":
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector as projector_class
        tower_prefix = "vision_tower.vision_model."   # the released checkpoints' names, the converter's map
    else:
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector as projector_class
        tower_prefix = "vision_tower."
    header = read_mmproj(mmproj)
    with _empty_weights():
        tower = AutoModel.from_config(config.vision_config, dtype=dtype)
        projector = projector_class(config).to(dtype)
    prefix = "multi_modal_projector."
    names = [tower_prefix + n for n in tower.state_dict()] + [prefix + n for n in projector.state_dict()]
    state = transformers_tensors(header, dtype, names)
    tower.load_state_dict({k.removeprefix(tower_prefix): v for k, v in state.items() if k.startswith(tower_prefix)},
                          strict=True, assign=True)
    projector.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)},
                              strict=True, assign=True)
    return tower.eval(), projector.eval()


def _empty_weights():
    """Modules built with their parameters allocated but not initialized (the file's tensors replace them), their
    computed buffers (positions, rotary frequencies) made as usual."""
    from transformers.initialization import no_init_weights
    return no_init_weights()


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


def llama4_modules(mmproj: Path, config, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' Llama 4 vision model (with its pixel-shuffle adapter) and ``Llama4MultiModalProjector`` holding
    the mmproj's tensors in ``dtype``."""
    from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel
    header = read_mmproj(mmproj)
    with _empty_weights():
        vision = Llama4VisionModel._from_config(config.vision_config, dtype=dtype)
        projector = Llama4MultiModalProjector(config).to(dtype)
    prefixes = ("vision_model.", "multi_modal_projector.")
    names = [prefixes[0] + n for n in vision.state_dict()] + [prefixes[1] + n for n in projector.state_dict()]
    state = transformers_tensors(header, dtype, names)
    for module, prefix in zip((vision, projector), prefixes, strict=True):
        module.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)},
                               strict=True, assign=True)
    return vision.eval(), projector.eval()


def vision_tower(mmproj: Path, vision_config, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Qwen2.5-VL or Qwen3-VL vision tower (patch embedding, vision blocks, patch merger; Qwen3-VL's
    learned positions and deepstack mergers) holding the mmproj's tensors in ``dtype``; ValueError naming a tensor
    the file lacks or one without a place in the tower."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    header = read_mmproj(mmproj)
    qwen3 = projector_of(header).model_type == "qwen3_vl"
    with _empty_weights():
        tower_class = Qwen3VLVisionModel if qwen3 else Qwen2_5_VisionTransformerPretrainedModel
        tower = tower_class._from_config(vision_config, dtype=dtype)
    state = transformers_tensors(header, dtype, [f"visual.{n}" for n in tower.state_dict()])
    tower.load_state_dict({k.removeprefix("visual."): v for k, v in state.items()}, strict=True, assign=True)
    return tower.eval()


def transformers_tensors(header: GGUFHeader, dtype: torch.dtype, names: list[str]) -> dict[str, torch.Tensor]:
    """The mmproj's tensors under the vision modules' parameter names ``names`` (transformers' checkpoint names:
    ``visual.`` for Qwen's towers, ``model.vision_model.`` and ``model.connector.`` for Idefics3's,
    ``vision_tower.`` and ``multi_modal_projector.`` for Gemma 3's and Mistral 3's), undoing the converter's renaming,
    splits and changes; ValueError for a tensor the file lacks or one left over."""
    import gguf as gguf_py
    meta = header.metadata
    tensors = {t.name: t for t in header.tensors}
    name_map = gguf_py.get_tensor_name_map(gguf_py.MODEL_ARCH.MMPROJ, meta["clip.vision.block_count"])
    projector = projector_of(header)
    deepstack = [i for i, on in enumerate(meta.get("clip.vision.is_deepstack_layers", [])) if on]
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
        elif base.endswith(".attn.qkv") and f"{name_map.get_name(base)}.{suffix}" not in tensors:
            # Qwen2.5-VL's stored split into q, k and v (Qwen3-VL's as it is)
            parts = [name_map.get_name(f"{base[:-3]}{p}") for p in "qkv"]
            state[name] = torch.cat([take(f"{p}.{suffix}") for p in parts])
        elif projector.model_type == "qwen3_vl" and (qwen3 := _qwen3_vl_merger_tensor(name, deepstack)) is not None:
            state[name] = take(qwen3)
        elif name == "multi_modal_projector.mm_input_projection_weight":   # Gemma 3's, a bare parameter
            state[name] = take(f"{name_map.get_name('multi_modal_projector.mm_input_projection')}.weight")
        elif projector.model_type == "llama4" and name in _LLAMA4_TENSORS:   # bare parameters, a one-layer projector
            state[name] = take(_LLAMA4_TENSORS[name])
        elif (mapped := name_map.get_name(base)) is not None:
            state[name] = take(f"{mapped}.{suffix}")
            if name == "multi_modal_projector.mm_soft_emb_norm.weight":
                state[name] = state[name] - 1   # Gemma 3's soft-embedding norm, stored as 1 + w
            elif projector.model_type == "mistral3" and base.endswith(("attention.q_proj", "attention.k_proj")):
                # Pixtral's q and k rows, interleaved by the converter for llama.cpp's rotary
                heads = meta["clip.vision.attention.head_count"]
                state[name] = state[name][_uninterleaved_rows(state[name].shape[0], heads)]
        else:
            raise ValueError(f"{header.path.name}: the vision tower's {name} has no tensor name in llama.cpp's map")
    # the [IMG_BREAK] token's embedding, which llama.cpp keeps beside the tower: lmport takes the text model's row
    unused = sorted(set(tensors) - used - {"v.token_embd.img_break"})
    if unused:
        raise ValueError(f"{header.path.name}: tensors {', '.join(unused[:4])} have no place in the "
                         f"{projector.family} vision tower built from its metadata")
    return state


# Llama 4's tensors the name map does not give by module and suffix: its class token and position table (bare
# parameters; the converter names the latter ``.weight``), its projector's single layer ``linear_1`` (``mm.model.fc``)
_LLAMA4_TENSORS = {"vision_model.class_embedding": "v.class_embd",
                   "vision_model.positional_embedding_vlm": "v.position_embd.weight",
                   "multi_modal_projector.linear_1.weight": "mm.model.fc.weight"}


def _qwen3_vl_merger_tensor(name: str, deepstack: list[int]) -> str | None:
    """The mmproj's name of a Qwen3-VL merger tensor (``visual.merger.*``, ``visual.deepstack_merger_list.*``), as
    the converter names them: the main merger's norm ``v.post_ln``, its layers ``mm.0`` and ``mm.2``; deepstack
    merger ``i`` under the vision block it reads (``v.deepstack.<block>.{norm,fc1,fc2}``); None for another."""
    parts = name.split(".")
    layers = {"linear_fc1": "fc1", "linear_fc2": "fc2", "norm": "norm"}
    if parts[:2] == ["visual", "merger"] and len(parts) == 4:
        return {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[parts[2]] + "." + parts[3]
    if parts[:2] == ["visual", "deepstack_merger_list"] and len(parts) == 5:
        return f"v.deepstack.{deepstack[int(parts[2])]}.{layers[parts[3]]}.{parts[4]}"
    return None


def _uninterleaved_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes the converter's interleaving of each head's q / k rows (LlamaModel.permute)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


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
    if projector.model_type == "gemma3":
        return _gemma3_image_processor(model, mmproj, meta)
    if projector.model_type == "mistral3":
        return _pixtral_image_processor(model, meta)
    if projector.model_type == "llama4":
        return _llama4_image_processor(model, meta)
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


def _gemma3_image_processor(model: Path, mmproj: Path, meta: dict):
    """Gemma 3's: transformers' Gemma3Processor over the text GGUF's tokenizer (its image tokens named) and Gemma 3's
    image processor (its PIL one) resizing every image to ``image_size`` square, ``mm_tokens_per_image`` soft tokens
    an image."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    from lmport.multimodal.gemma3 import Gemma3ImageProcessor
    from lmport.weights.gguf_tokenizer import gguf_tokenizer
    config = checkpoint_config(model, mmproj)
    tokenizer = gguf_tokenizer(model)
    names = {"boi_token": _GEMMA3_TOKENS["boi_token_index"], "eoi_token": _GEMMA3_TOKENS["eoi_token_index"],
             "image_token": _GEMMA3_TOKENS["image_token_index"]}
    for attribute, text in names.items():   # what Gemma3Processor reads of a Gemma 3 tokenizer
        setattr(tokenizer, attribute, text)
        setattr(tokenizer, f"{attribute}_id", tokenizer.convert_tokens_to_ids(text))
    size = meta["clip.vision.image_size"]
    images = Gemma3ImageProcessorPil(size={"height": size, "width": size},
                                     image_mean=list(meta["clip.vision.image_mean"]),
                                     image_std=list(meta["clip.vision.image_std"]))
    processor = Gemma3Processor(images, tokenizer, image_seq_length=config.mm_tokens_per_image)
    return Gemma3ImageProcessor(processor, meta["clip.vision.patch_size"])


def _pixtral_image_processor(model: Path, meta: dict):
    """Mistral 3's: Pixtral's image processor (its PIL one) fitting the longest side in ``image_size``, in whole
    merged cells, and the text GGUF's ``[IMG]``, ``[IMG_BREAK]`` and ``[IMG_END]``."""
    from transformers import PixtralImageProcessorPil

    from lmport.multimodal.pixtral import PixtralImageProcessor
    patch = meta["clip.vision.patch_size"]
    images = PixtralImageProcessorPil(size={"longest_edge": meta["clip.vision.image_size"]},
                                      patch_size={"height": patch, "width": patch},
                                      image_mean=list(meta["clip.vision.image_mean"]),
                                      image_std=list(meta["clip.vision.image_std"]))
    ids = placeholder_ids(model, dict(zip(("image", "break", "end"), _PIXTRAL_TOKENS)))
    return PixtralImageProcessor(images, ids["image"], ids["break"], ids["end"], patch,
                                 meta.get("clip.vision.spatial_merge_size", 1))


def _llama4_image_processor(model: Path, meta: dict):
    """Llama 4's: its tiles of ``image_size`` (at most ``LLAMA4_MAX_TILES`` and a global view) and the token
    layout of transformers' ``Llama4Processor``, with the text GGUF's image tokens (lmport.multimodal.llama4)."""
    from lmport.multimodal.llama4 import TOKEN_DEFAULTS, Llama4ImageProcessor
    size = meta["clip.vision.image_size"]
    settings = {"size": {"height": size, "width": size}, "max_patches": LLAMA4_MAX_TILES,
                "image_mean": list(meta["clip.vision.image_mean"]), "image_std": list(meta["clip.vision.image_std"])}
    return Llama4ImageProcessor(settings, placeholder_ids(model, TOKEN_DEFAULTS), meta["clip.vision.patch_size"],
                                1.0 / meta.get("clip.vision.projector.scale_factor", _LLAMA4_SHUFFLE))


def largest_image_patches(mmproj: Path) -> int:
    """Patches of the largest image the pair's processor makes (the memory plan's encoder reserve): Qwen's pixel
    limit (``image_max_pixels``, else llama.cpp's 4096 tokens), Gemma 3's and Pixtral's ``image_size`` square,
    Idefics3's tiles of its ``preproc_image_size`` and the global image; Llama 4's one tile and its class token
    (each tile is encoded as an image of its own)."""
    meta = read_mmproj(mmproj).metadata
    kind = projector_of(read_mmproj(mmproj)).model_type
    patch, size = meta["clip.vision.patch_size"], meta["clip.vision.image_size"]
    if kind in ("qwen2_5_vl", "qwen3_vl"):
        cell = patch * meta.get("clip.vision.spatial_merge_size", _MERGE_SIZE)
        pixels = meta.get("clip.vision.image_max_pixels", _QWEN2_VL_TOKEN_LIMITS[1] * cell * cell)
        return -(-pixels // (patch * patch))
    if kind == "idefics3":
        side = -(-meta.get("clip.vision.preproc_image_size", size) // size)
        return (side * side + 1) * (size // patch) ** 2
    if kind == "llama4":
        return (size // patch) ** 2 + 1
    return (size // patch) ** 2
