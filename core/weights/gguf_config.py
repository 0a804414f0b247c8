"""The config of a Llama GGUF (the default model's architecture) without importing transformers' Llama config
module.

In transformers 5.23 every ``configuration_<model>.py`` imports ``transformers.utils.type_validators``,
which imports ``transformers.activations`` to check ``hidden_act`` against ``ACT2FN``; that imports its
hub-kernel registry, which pulls in ``torch._dynamo`` and ``torch.distributed.tensor``: 1.5-3 s and about
155 MiB of RSS on a 2-core machine, the largest part of a cold load of the default model. Nothing else a
GGUF load does needs that module.

``GGUFLlamaConfig`` is transformers' ``LlamaConfig`` as a plain subclass of ``PreTrainedConfig`` (which
imports none of it): the same fields, defaults and ``__post_init__`` (rope parameters standardized by the
base class), ``model_type = "llama"``, so ``to_dict()`` / ``save_pretrained`` write what LlamaConfig writes.
What it leaves out is the type validation LlamaConfig's ``@strict`` adds. ``tests/test_gguf_config.py`` checks
its fields and defaults against LlamaConfig's and the configs made of the test GGUFs and the default model
against transformers' own. Where a transformers model must be built from it (a rotary module lmport does not
implement), ``as_transformers_config`` gives transformers' class.
"""
from __future__ import annotations

from transformers.configuration_utils import PreTrainedConfig


class GGUFLlamaConfig(PreTrainedConfig):
    """transformers' ``LlamaConfig`` (fields, defaults, post-init), for a GGUF of architecture ``llama``."""

    model_type = "llama"
    keys_to_ignore_at_inference = ["past_key_values"]   # noqa: RUF012 -- as LlamaConfig declares it

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    head_dim: int | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"The hidden size ({self.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({self.num_attention_heads}).")


def as_transformers_config(cfg):
    """``cfg`` as transformers' own config class (a ``GGUFLlamaConfig`` becomes a ``LlamaConfig``: this imports
    ``transformers.activations``); any other config as it is."""
    if not isinstance(cfg, GGUFLlamaConfig):
        return cfg
    from transformers import LlamaConfig
    return LlamaConfig(**cfg.to_dict())
