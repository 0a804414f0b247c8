"""EngineConfig and GenerationConfig: plain values whose fields are checked at construction.

Constructing one never imports a backend or reads the installed plugins: checking an EngineConfig against the
chosen backend, and filling in that backend's defaults, is one separate step (lmport.platform.resolution). Field names
follow LMDeploy's PytorchEngineConfig and GenerationConfig.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, cast

from lmport.errors import ConfigError

if TYPE_CHECKING:
    from lmport.platform.backend import Backend

__all__ = ["Adjustment", "ConfigError", "EngineConfig", "GenerationConfig", "SpeculativeConfig"]

DTYPES = ("auto", "float16", "bfloat16", "float32")
KV_CACHE_DTYPES = DTYPES   # "auto": the model's dtype
# quant_policy: 0 (off), 8 (INT8), 4 (INT4) or "fp8" (float8 e4m3; "fp8_e4m3" is the same), LMDeploy's values.
# vLLM's kv_cache_dtype="fp8" / "fp8_e4m3" names the same cache and is taken as quant_policy="fp8".
FP8_NAMES = ("fp8", "fp8_e4m3")
WEIGHT_FORMATS = ("auto", "dequantize")
MAX_LORA_RANK = 256
EXECUTORS = ("mp", "ray")
# `lmport serve`'s decode_prefill_tokens: a step of this many prompt tokens stays under a second for SmolLM2-135M
# on a 2-core CPU, the bound on a stream's wait between two tokens (docs/server.md); a faster device can take more.
SERVE_DECODE_PREFILL_TOKENS = 128


class Adjustment(NamedTuple):
    field: str
    asked: object
    used: object
    reason: str


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``; docs/speculative.md).

    ``ngram`` proposes the tokens that followed the latest earlier occurrence of the last n tokens
    (prompt lookup, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``); ``draft`` runs ``model``,
    a smaller model sharing the target's tokenizer. The target verifies every proposal in one batched
    forward; the output distribution is the target's own.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 8         # the most; a sequence's proposals grow and shrink (ProposalLength)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None                # the draft model (a path or short name) for method "draft"
    # No speculation while more than this many sequences run: a full batch already streams the weights once
    # for many tokens, and verifying rejected proposals would only add work.
    disable_by_batch_size: int = 4
    # A sequence whose recent proposals are accepted less than this share of the time stops proposing for a
    # while (its verification costs more than the accepted tokens save).
    min_acceptance: float = 0.25
    # Speculation pauses for every sequence while decode steps that verify proposals emit fewer tokens a
    # second than plain ones (timed as the engine runs; lmport.speculative.speculator.Payoff).
    pause_when_slower: bool = True

    def __post_init__(self):
        _check(self.method in SPECULATIVE_METHODS,
               f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        _check(_is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
               f"speculative.num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, f"speculative.{name} must be an int >= 1, got {value!r}")
        _check(self.prompt_lookup_min <= self.prompt_lookup_max,
               f"speculative.prompt_lookup_min={self.prompt_lookup_min} is more than prompt_lookup_max="
               f"{self.prompt_lookup_max}: give min <= max")
        if self.method == "draft":
            _check(isinstance(self.model, str) and bool(self.model),
                   "speculative.method='draft' needs speculative.model: the path or short name of a smaller "
                   "model with the same tokenizer")
        else:
            _check(self.model is None, f"speculative.model={self.model!r} is only read by method 'draft'; drop it "
                                       f"or use method='draft'")
        _check(_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1,
               f"speculative.disable_by_batch_size must be an int >= 1, got {self.disable_by_batch_size!r}")
        _check(_is_number(self.min_acceptance) and 0 <= self.min_acceptance < 1,
               f"speculative.min_acceptance must be a number in [0, 1), got {self.min_acceptance!r}")
        _check(isinstance(self.pause_when_slower, bool),
               f"speculative.pause_when_slower must be True or False, got {self.pause_when_slower!r}")

    @classmethod
    def of(cls, value) -> SpeculativeConfig | None:
        """A SpeculativeConfig from itself, a dict of its fields, or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        _check(isinstance(value, dict), f"speculative must be a dict of SpeculativeConfig fields (or None), "
                                        f"got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        _check(not unknown, f"speculative: unknown field(s) {', '.join(map(str, unknown))}; the fields are "
                            f"{', '.join(sorted(names))}")
        return cls(**value)


@dataclass
class EngineConfig:
    device_type: str = "auto"
    dtype: str = "auto"
    block_size: int | None = None            # None: the backend's default
    cache_max_entry_count: float | int | None = None  # None: the backend's default fraction
    quant_policy: int | str = 0
    # The dtype an unquantized cache (quant_policy 0) keeps K and V in; "auto": the model's dtype. A float32 model's
    # cache in float16 (Capabilities.kv_cache_dtypes: cpu) holds twice the tokens, and a decode step reads half the
    # bytes of its history, as llama.cpp's default f16 cache (docs/kv-quantization.md).
    kv_cache_dtype: str = "auto"
    max_batch_size: int = 64
    max_prefill_token_num: int = 4096
    # Prompt tokens a step may compute while other sequences decode (decode-first chunked prefill): a running
    # stream waits at most one such step between two tokens. None: no bound but max_prefill_token_num, what an
    # offline batch wants (the fewest, fullest steps). `lmport serve`, whose clients watch each stream, sets
    # SERVE_DECODE_PREFILL_TOKENS (docs/server.md).
    decode_prefill_tokens: int | None = None
    session_len: int | None = None           # None: the model's max_position_embeddings
    enable_prefix_caching: bool = False
    host_cache_gib: float = 0.0
    tp: int = 1
    # False: decode steps replay captured graphs; True: every step runs eagerly; None: graphs where the backend
    # captures them (Capabilities.decode_graphs, at tp=1 without LoRA), as LMDeploy and vLLM default on CUDA.
    eager_mode: bool | None = None
    # "auto": a quantized checkpoint keeps its 4-/8-bit (or fp8) weights (docs/weight-quantization.md);
    # "dequantize": its weights are dequantized to dtype at load (for a backend without its format).
    weight_format: str = "auto"
    # The vision tower of a GGUF text model: llama.cpp's mmproj GGUF of the same checkpoint (docs/vision.md).
    mmproj: str | None = None
    # Tensor parallelism across nodes (docs/distributed.md): tp ranks split evenly over nnodes nodes.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None        # HOST:PORT of the rendezvous (node 0); None: a free local port
    dist_timeout: float = 300.0              # seconds any collective may wait before it fails
    # LoRA adapters served over the base model (docs/lora.md): how many can be loaded at once (0: off, no
    # adapter weights held) and the highest adapter rank they may have; both size the adapter memory.
    max_loras: int = 0
    max_lora_rank: int = 16
    # Where ranks 1..tp-1 run (docs/distributed.md): "mp" worker processes of this node (and `lmport worker` on
    # others), "ray" Ray actors placed by a placement group. At tp=1 the runner is in the engine's process.
    executor: str = "mp"
    ray_address: str | None = None           # an existing Ray cluster ("auto", "HOST:PORT"); None: RAY_ADDRESS or local
    # Speculative decoding: a SpeculativeConfig or a dict of its fields ({"method": "ngram"}); None: off.
    speculative: dict | SpeculativeConfig | None = None
    # Set by lmport.platform.resolution.resolve_config: what the backend changed, and the backend itself.
    adjustments: tuple[Adjustment, ...] = field(default=(), compare=False)
    # (a plain ``type``: the CLI reads these annotations at run time, where Backend is not imported)
    resolved_backend: type | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        _check(isinstance(self.device_type, str) and self.device_type,
               f"device_type must be a backend name or 'auto', got {self.device_type!r}")
        _check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.block_size is None or (_is_int(self.block_size) and self.block_size >= 1),
               f"block_size must be an int >= 1 (or None for the backend default), got {self.block_size!r}")
        c = self.cache_max_entry_count
        _check(c is None or (_is_int(c) and c >= 1) or (isinstance(c, float) and 0 < c <= 1),
               f"cache_max_entry_count must be a float in (0, 1] (share of free memory) or an int >= 1 "
               f"(exact number of blocks), got {c!r}")
        self._resolve_fp8_names()
        _check(self.quant_policy == "fp8" or (_is_int(self.quant_policy) and self.quant_policy in (0, 4, 8)),
               f"quant_policy must be 0 (off), 8 (INT8), 4 (INT4) or 'fp8' (float8 e4m3), got {self.quant_policy!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, or 'fp8' / 'fp8_e4m3' (vLLM's names for "
               f"quant_policy='fp8'), got {self.kv_cache_dtype!r}")
        for name in ("max_batch_size", "max_prefill_token_num", "tp", "nnodes"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, f"{name} must be an int >= 1, got {value!r}")
        d = self.decode_prefill_tokens
        _check(d is None or (_is_int(d) and d >= 1),
               f"decode_prefill_tokens must be an int >= 1 (or None for no bound), got {d!r}")
        _check(self.session_len is None or (_is_int(self.session_len) and self.session_len >= 1),
               f"session_len must be an int >= 1 (or None for the model's limit), got {self.session_len!r}")
        _check(self.weight_format in WEIGHT_FORMATS,
               f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weight_format!r}")
        _check(self.mmproj is None or (isinstance(self.mmproj, str) and self.mmproj.strip() != ""),
               f"mmproj must be the path of an mmproj GGUF file (or None), got {self.mmproj!r}")
        _check(_is_number(self.host_cache_gib) and self.host_cache_gib >= 0,
               f"host_cache_gib must be a number >= 0, got {self.host_cache_gib!r}")
        _check(self.tp % self.nnodes == 0, f"tp={self.tp} must split evenly over nnodes={self.nnodes} "
                                           f"(the same number of ranks on every node)")
        _check(_is_int(self.node_rank) and 0 <= self.node_rank < self.nnodes,
               f"node_rank must be an int in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        _check(self.nnodes == 1 or (isinstance(self.dist_init_addr, str) and ":" in self.dist_init_addr),
               f"nnodes={self.nnodes} needs dist_init_addr=HOST:PORT of node 0 (the rendezvous every node joins)")
        _check(self.dist_init_addr is None or (isinstance(self.dist_init_addr, str)
                                               and self.dist_init_addr.rpartition(":")[2].isdigit()),
               f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        _check(_is_number(self.dist_timeout) and self.dist_timeout > 0,
               f"dist_timeout must be a number of seconds > 0, got {self.dist_timeout!r}")
        _check(_is_int(self.max_loras) and self.max_loras >= 0,
               f"max_loras must be an int >= 0 (0: no LoRA adapters), got {self.max_loras!r}")
        _check(_is_int(self.max_lora_rank) and 1 <= self.max_lora_rank <= MAX_LORA_RANK,
               f"max_lora_rank must be an int in [1, {MAX_LORA_RANK}], got {self.max_lora_rank!r}")
        _check(self.max_loras == 0 or self.tp == 1,
               f"max_loras={self.max_loras} with tp={self.tp}: LoRA adapters run at tp=1 only; use tp=1 or max_loras=0")
        _check(self.executor in EXECUTORS, f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        _check(self.executor != "ray" or self.nnodes == 1,
               f"executor='ray' places the {self.tp} ranks on the Ray cluster's nodes itself: leave nnodes at 1 "
               f"(nnodes={self.nnodes} is for the 'mp' executor with `lmport worker` on each node)")
        _check(self.ray_address is None or (isinstance(self.ray_address, str) and self.ray_address),
               f"ray_address must be 'auto', HOST:PORT or ray://HOST:PORT of a Ray cluster, got {self.ray_address!r}")
        _check(self.eager_mode is None or isinstance(self.eager_mode, bool),
               f"eager_mode must be True, False or None (the backend's choice), got {self.eager_mode!r}")
        _check(isinstance(self.enable_prefix_caching, bool),
               f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        self.speculative = SpeculativeConfig.of(self.speculative)

    def _resolve_fp8_names(self) -> None:
        """quant_policy "fp8_e4m3" is "fp8"; vLLM's kv_cache_dtype "fp8" / "fp8_e4m3" is quant_policy "fp8" (with the
        cache dtype left to it)."""
        if self.quant_policy in FP8_NAMES:
            self.quant_policy = "fp8"
        if self.kv_cache_dtype in FP8_NAMES:
            _check(self.quant_policy in (0, "fp8"),
                   f"kv_cache_dtype={self.kv_cache_dtype!r} asks for an fp8 KV cache (quant_policy='fp8') but "
                   f"quant_policy={self.quant_policy!r} asks for another; give one of them")
            self.quant_policy, self.kv_cache_dtype = "fp8", "auto"

    def backend_class(self) -> type[Backend]:
        """The backend this config was resolved against (lmport.platform.resolution.resolve_config)."""
        if self.resolved_backend is None:
            raise ConfigError("this EngineConfig is not resolved against a backend yet: pass it through "
                              "lmport.platform.resolution.resolve_config first")
        return cast("type[Backend]", self.resolved_backend)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_k: int = 0                      # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0       # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0      # OpenAI's: subtracted per time a token was generated
    do_sample: bool = False             # False: greedy, whatever the sampling fields say
    random_seed: int | None = None
    stop_token_ids: list[int] | None = None   # None: the model's end-of-sequence tokens
    stop_words: list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None         # number of top logprobs to return per token
    skip_special_tokens: bool = True
    response_format: dict | None = None  # structured output (JSON schema, regex, grammar)
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to a token's logit before sampling
    # The prompt's own log-probabilities (each token given those before it) and the top N alternatives at each
    # position, computed as the prompt is prefilled (completions echo, get_ppl); with it, max_new_tokens may be 0.
    prompt_logprobs: int | None = None
    speculate: bool = True              # False: this request never speculates (EngineConfig.speculative)

    def __post_init__(self):
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be an int in [0, 20] or None, got {self.prompt_logprobs!r}")
        least = 0 if self.prompt_logprobs is not None else 1   # scoring a prompt alone generates nothing
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= least,
               f"max_new_tokens must be an int >= {least}, got {self.max_new_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a number >= 0, got {self.temperature!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an int >= 0, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be a number in [-2, 2], got {value!r}")
        _check(self.random_seed is None or _is_int(self.random_seed),
               f"random_seed must be an int or None, got {self.random_seed!r}")
        _check(self.stop_token_ids is None or all(_is_int(t) for t in self.stop_token_ids),
               f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        _check(self.stop_words is None or all(isinstance(s, str) and s for s in self.stop_words),
               f"stop_words must be a list of non-empty strings, got {self.stop_words!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be an int in [0, 20] or None, got {self.logprobs!r}")
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_number(b) and abs(b) < float("inf") for t, b in self.logit_bias.items())),
               f"logit_bias must map token ids to finite numbers, got {self.logit_bias!r}")
        _check(isinstance(self.speculate, bool), f"speculate must be True or False, got {self.speculate!r}")
        if self.response_format is not None:
            from lmport.structured_output.grammar import GuidedDecodingError, grammar_key
            try:
                grammar_key(self.response_format)
            except GuidedDecodingError as exc:
                raise ConfigError(str(exc)) from None

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0 or self.top_k == 1
