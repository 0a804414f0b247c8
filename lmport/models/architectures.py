"""Which paged model class runs each transformers ``model_type``; everything else is refused by name."""
from __future__ import annotations

from lmport.kv.layout import CacheKind
from lmport.models.deepseek_v3 import DEEPSEEK_V3_MODEL_TYPES, DeepseekV3CausalLM
from lmport.models.gemma import GEMMA_MODEL_TYPES, GemmaCausalLM
from lmport.models.glm4_moe import GLM4_MOE_MODEL_TYPES, Glm4MoeCausalLM
from lmport.models.gpt_oss import GPT_OSS_MODEL_TYPES, GptOssCausalLM
from lmport.models.llama4 import LLAMA4_MODEL_TYPES, Llama4CausalLM
from lmport.models.llama import SUPPORTED_MODEL_TYPES as LLAMA_MODEL_TYPES
from lmport.models.llama import PagedCausalLM
from lmport.models.moe import MOE_MODEL_TYPES, MoeCausalLM
from lmport.models.phi3 import PHI3_MODEL_TYPES, Phi3CausalLM
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
}


def supported_text() -> str:
    return ", ".join(MODEL_CLASSES)


def model_class(cfg) -> type[PagedCausalLM]:
    """The paged model class for ``cfg``; ValueError naming the supported model types otherwise."""
    cls = MODEL_CLASSES.get(cfg.model_type)
    if cls is None:
        raise ValueError(f"model type {cfg.model_type!r} is not supported; supported: {supported_text()}")
    return cls


def attention_variants(cfg) -> set[str]:
    """The attention variants ``cfg``'s model needs of a backend (PagedCausalLM.attention_variants)."""
    return model_class(cfg).attention_variants(cfg)


def cache_kinds(cfg, tp_size: int = 1) -> tuple[CacheKind, ...]:
    """What each layer of ``cfg``'s model caches a token on one of ``tp_size`` ranks (PagedCausalLM.cache_kinds);
    a model type lmport does not run is sized as paged K/V (its refusal comes when it loads)."""
    return MODEL_CLASSES.get(cfg.model_type, PagedCausalLM).cache_kinds(cfg, tp_size)


def recurrent_state(cfg, dtype):
    """One sequence's fixed-size recurrent state (lmport.kv.state_pool.RecurrentStateSpec) for a model whose
    linear-attention layers keep one (Qwen3-Next); None for a model that keeps only paged K/V."""
    spec = getattr(MODEL_CLASSES.get(cfg.model_type), "recurrent_state", None)
    return spec(cfg, dtype) if spec is not None else None
