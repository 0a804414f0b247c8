"""What crosses between the HTTP front end and the engine core: plain values, packed with msgpack.

Front end to core (the request queue): ``["add", EngineRequest.to_wire()]``, ``["abort", request_id]``,
``["call", call_id, name, args]`` (a control call between steps: ``CALLS``), ``["shutdown"]``. Core to front
end (the output queue): ``["ready", EngineInfo.to_wire(), usage, adapters]`` once, ``["outputs", [wire output,
...], usage, failure]`` once a step (every output of the step in one message), ``["rejected", request_id,
error]`` for a request ``add_request`` refused, ``["reply", call_id, value, error]`` for a call, and
``["failed", reason]`` when the core stops. An error is ``error_to_wire``'s dict: its type, message, and a LoRA
adapter error's status and param. No pickled objects: a message is lists, dicts, strings, bytes and numbers.

A new request field is one field on ``EngineRequest`` (or on ``GenerationConfig``, which travels as its
dict); both sides read it by name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import msgpack

from lmport.config import GenerationConfig
from lmport.engine.outputs import ErrorKind, FinishReason, RequestError, RequestOutput
from lmport.lora import AdapterError
from lmport.lora.table import LoadedAdapter
from lmport.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from lmport.engine.core import EngineCore

# The control calls the core runs between steps (EngineCore methods); each replies with a LoadedAdapter's dict.
CALLS = ("load_adapter", "unload_adapter")


@dataclass
class EngineRequest:
    """One generation as the engine core receives it."""
    request_id: str
    prompt_ids: list[int]
    gen_config: GenerationConfig = field(default_factory=GenerationConfig)
    cache_salt: str | None = None   # only requests with the same salt share prefix-cache blocks
    adapter: str | None = None      # the loaded LoRA adapter it runs with (None: the base model)
    pooling: str | None = None      # an embedding request: "mean" or "last" (lmport.engine.pooling)
    images: list[ImageInput] | None = None   # the prompt's images, in prompt order (lmport.multimodal)

    def to_wire(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "gen_config": dataclasses.asdict(self.gen_config),
                "images": None if self.images is None else [image.to_wire() for image in self.images]}

    @classmethod
    def from_wire(cls, data: dict) -> EngineRequest:
        images = data.get("images")
        return cls(**{**data, "gen_config": GenerationConfig(**data["gen_config"]),
                      "images": None if images is None else [ImageInput.from_wire(i) for i in images]})


@dataclass(frozen=True)
class EngineInfo:
    """The facts about the loaded engine that the front end checks requests against and reports."""
    model_name: str
    vocab_size: int
    hidden_size: int
    session_len: int
    eos_token_ids: list[int]
    max_batch_size: int
    max_prefill_token_num: int
    num_blocks: int
    device_type: str
    dtype: str
    quant_policy: int | str   # 0, 8, 4 or "fp8"
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(cls, engine: EngineCore) -> EngineInfo:
        cfg = engine.config
        return cls(engine.model_name, engine.model_config.vocab_size, engine.model_config.hidden_size,
                   engine.session_len,
                   list(engine.eos_token_ids), cfg.max_batch_size, cfg.max_prefill_token_num,
                   engine.plan.num_blocks, cfg.device_type, cfg.dtype, cfg.quant_policy, cfg.kv_cache_dtype)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> EngineInfo:
        return cls(**data)


def output_to_wire(out: RequestOutput) -> list:
    """A step's output as its deltas: token ids and no text (the core makes none; the front end's output
    processor, lmport.engine.output_processor, decodes them). The finish reason and error kind travel as their
    strings."""
    return [out.request_id, out.delta_token_ids, out.delta_logprobs, out.finished, out.finish_reason, out.error,
            out.prompt_tokens, out.cached_tokens, out.prompt_logprobs, out.embedding, out.error_kind]


def output_from_wire(data: list) -> RequestOutput:
    (request_id, tokens, logprobs, finished, reason, error, prompt_tokens, cached, prompt_logprobs, embedding,
     error_kind) = data
    return RequestOutput(request_id, [], "", tokens, "", finished, None if reason is None else FinishReason(reason),
                         prompt_tokens, cached, error=error, delta_logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                         embedding=embedding, error_kind=None if error_kind is None else ErrorKind(error_kind))


def adapter_to_wire(adapter: LoadedAdapter) -> dict:
    return dataclasses.asdict(adapter)


def adapter_from_wire(data: dict) -> LoadedAdapter:
    return LoadedAdapter(**data)


def error_to_wire(exc: Exception) -> dict:
    if isinstance(exc, AdapterError):
        return {"type": "AdapterError", "message": str(exc), "status": exc.status, "param": exc.param}
    return {"type": "RequestError" if isinstance(exc, RequestError) else type(exc).__name__,
            "message": str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"}


def error_from_wire(data: dict) -> Exception:
    """An AdapterError as the core raised it; any other error as a RequestError with its message."""
    if data["type"] == "AdapterError":
        return AdapterError(data["message"], data["param"], data["status"])
    return RequestError(data["message"])


def pack(message: list) -> bytes:
    return cast(bytes, msgpack.packb(message, use_bin_type=True))   # None only with a file-like `stream`


def unpack(data: bytes) -> list:
    # Logprobs are maps keyed by token id: integer keys are allowed.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
