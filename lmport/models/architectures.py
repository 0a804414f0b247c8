"""Which paged model class runs each transformers ``model_type``; everything else is refused by name."""
from __future__ import annotations

from lmport.kv.layout import CacheKind
from lmport.models.deepseek_v3 import DEEPSEEK_V3_MODEL_TYPES, DeepseekV3CausalLM
from lmport.models.gemma import GEMMA_MODEL_TYPES, GemmaCausalLM
from lmport.models.gemma3_vl import GEMMA3_VL_MODEL_TYPES, Gemma3VLCausalLM, gemma3_text_view
from lmport.models.glm4_moe import GLM4_MOE_MODEL_TYPES, Glm4MoeCausalLM
from lmport.models.gpt_oss import GPT_OSS_MODEL_TYPES, GptOssCausalLM
from lmport.models.idefics3 import IDEFICS3_MODEL_TYPES, Idefics3CausalLM, idefics3_text_view
from lmport.models.llama4 import LLAMA4_MODEL_TYPES, Llama4CausalLM
from lmport.models.llama4_vl import LLAMA4_VL_MODEL_TYPES, Llama4VLCausalLM, llama4_text_view
from lmport.models.llama import SUPPORTED_MODEL_TYPES as LLAMA_MODEL_TYPES
from lmport.models.llama import PagedCausalLM
from lmport.models.mistral3 import MISTRAL3_MODEL_TYPES, Mistral3CausalLM, mistral3_text_view
from lmport.models.moe import MOE_MODEL_TYPES, MoeCausalLM
from lmport.models.phi3 import PHI3_MODEL_TYPES, Phi3CausalLM
from lmport.models.qwen3_5 import QWEN3_5_MODEL_TYPES, QWEN3_5_WRAPPER_TYPES, Qwen3_5CausalLM, text_model_config
from lmport.models.qwen2_vl import QWEN2_VL_MODEL_TYPES, Qwen2VLCausalLM, text_view
from lmport.models.qwen3_vl import QWEN3_VL_MODEL_TYPES, Qwen3VLCausalLM
from lmport.models.qwen3_next import QWEN3_NEXT_MODEL_TYPES, Qwen3NextCausalLM

MODEL_CLASSES: dict[str, type[PagedCausalLM]] = {
    **{t: PagedCausalLM for t in LLAMA_MODEL_TYPES},
    **{t: GemmaCausalLM for t in GEMMA_MODEL_TYPES},
    **{t: Phi3CausalLM for t in PHI3_MODEL_TYPES},
    **{t: MoeCausalLM for t in MOE_MODEL_TYPES},
    **{t: Glm4MoeCausalLM for t in GLM4_MOE_MODEL_TYPES},
    **{t: GptOssCausalLM for t in GPT_OSS_MODEL_TYPES},
    **{t: Llama4CausalLM for t in LLAMA4_MODEL_TYPES},
    **{t: DeepseekV3CausalLM for t in DEEPSEEK_V3_MODEL_TYPES},
    **{t: Qwen3NextCausalLM for t in QWEN3_NEXT_MODEL_TYPES},
    **{t: Qwen3_5CausalLM for t in QWEN3_5_MODEL_TYPES},
    **{t: Qwen2VLCausalLM for t in QWEN2_VL_MODEL_TYPES},
    **{t: Qwen3VLCausalLM for t in QWEN3_VL_MODEL_TYPES},
    **{t: Idefics3CausalLM for t in IDEFICS3_MODEL_TYPES},
    **{t: Mistral3CausalLM for t in MISTRAL3_MODEL_TYPES},
    **{t: Gemma3VLCausalLM for t in GEMMA3_VL_MODEL_TYPES},
    **{t: Llama4VLCausalLM for t in LLAMA4_VL_MODEL_TYPES},
}
# Image-text checkpoints: lmport's config is a text view of theirs: Qwen2.5-VL's keeps its vision config
# (lmport.models.qwen2_vl runs the vision tower), Idefics3's its Llama text config with its vision config beside it
# (lmport.models.idefics3), Qwen3.5's is its text model's (its vision tower is not loaded); Qwen3-VL's is read as
# Qwen2.5-VL's (lmport.models.qwen3_vl).
TEXT_VIEWS = {**{t: text_view for t in QWEN2_VL_MODEL_TYPES + QWEN3_VL_MODEL_TYPES},
              **{t: idefics3_text_view for t in IDEFICS3_MODEL_TYPES},
              **{t: mistral3_text_view for t in MISTRAL3_MODEL_TYPES},   # its Mistral text config (models.mistral3)
              **{t: gemma3_text_view for t in GEMMA3_VL_MODEL_TYPES},    # its Gemma 3 text config (models.gemma3_vl)
              **{t: llama4_text_view for t in LLAMA4_VL_MODEL_TYPES},    # its Llama 4 text config (models.llama4_vl)
              **{t: text_model_config for t in QWEN3_5_WRAPPER_TYPES}}


def supported_text() -> str:
    return ", ".join(MODEL_CLASSES)


def model_class(cfg) -> type[PagedCausalLM]:
    """The paged model class for ``cfg``; ValueError naming the supported model types otherwise."""
    cls = MODEL_CLASSES.get(cfg.model_type)
    if cls is None:
        raise ValueError(f"model type {cfg.model_type!r} is not supported; supported: {supported_text()}")
    return cls


def lmport_config(cfg):
    """The config lmport plans and builds a model from: a vision-language checkpoint's text view (its decoder's
    dimensions, with the vision config beside them), any other config as it is."""
    view = TEXT_VIEWS.get(cfg.model_type)
    return cfg if view is None or not hasattr(cfg, "text_config") else view(cfg)


def transformers_class(cfg):
    """The transformers auto class that loads ``cfg``'s checkpoint (image-text-to-text for a vision-language one)."""
    import transformers
    if cfg.model_type in (QWEN2_VL_MODEL_TYPES + QWEN3_VL_MODEL_TYPES + IDEFICS3_MODEL_TYPES + MISTRAL3_MODEL_TYPES
                          + GEMMA3_VL_MODEL_TYPES + LLAMA4_VL_MODEL_TYPES):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def adopt_transformers_modules(paged: PagedCausalLM, hf) -> None:
    """What the paged model takes from the loaded transformers model as is: its rotary module (every rope variant
    transformers knows) and, for a vision-language model, its vision tower."""
    adopt = getattr(paged, "adopt", None)
    if callable(adopt):
        adopt(hf)
    else:
        paged.rotary = hf.model.rotary_emb


def attention_variants(cfg) -> set[str]:
    """The attention variants ``cfg``'s model needs of a backend (PagedCausalLM.attention_variants)."""
    return model_class(cfg).attention_variants(cfg)


def cache_kinds(cfg, tp_size: int = 1) -> tuple[CacheKind, ...]:
    """What each layer of ``cfg``'s model caches a token on one of ``tp_size`` ranks (PagedCausalLM.cache_kinds);
    a model type lmport does not run is sized as paged K/V (its refusal comes when it loads)."""
    return MODEL_CLASSES.get(cfg.model_type, PagedCausalLM).cache_kinds(cfg, tp_size)


def recurrent_state(cfg, dtype):
    """One sequence's fixed-size recurrent state (lmport.kv.state_pool.RecurrentStateSpec) for a model whose
    linear-attention layers keep one (Qwen3-Next, Qwen3.5); None for a model that keeps only paged K/V."""
    spec = getattr(MODEL_CLASSES.get(cfg.model_type), "recurrent_state", None)
    return spec(cfg, dtype) if spec is not None else None
