"""Which paged model class runs each transformers ``model_type``; everything else is refused by name."""
from __future__ import annotations

from lmport.models.gemma import GEMMA_MODEL_TYPES, GemmaCausalLM
from lmport.models.glm4_moe import GLM4_MOE_MODEL_TYPES, Glm4MoeCausalLM
from lmport.models.gpt_oss import GPT_OSS_MODEL_TYPES, GptOssCausalLM
from lmport.models.llama4 import LLAMA4_MODEL_TYPES, Llama4CausalLM
from lmport.models.llama import SUPPORTED_MODEL_TYPES as LLAMA_MODEL_TYPES
from lmport.models.llama import PagedCausalLM
from lmport.models.moe import MOE_MODEL_TYPES, MoeCausalLM
from lmport.models.phi3 import PHI3_MODEL_TYPES, Phi3CausalLM

MODEL_CLASSES: dict[str, type[PagedCausalLM]] = {
    **{t: PagedCausalLM for t in LLAMA_MODEL_TYPES},
    **{t: GemmaCausalLM for t in GEMMA_MODEL_TYPES},
    **{t: Phi3CausalLM for t in PHI3_MODEL_TYPES},
    **{t: MoeCausalLM for t in MOE_MODEL_TYPES},
    **{t: Glm4MoeCausalLM for t in GLM4_MOE_MODEL_TYPES},
    **{t: GptOssCausalLM for t in GPT_OSS_MODEL_TYPES},
    **{t: Llama4CausalLM for t in LLAMA4_MODEL_TYPES},
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
