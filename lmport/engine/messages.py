"""What crosses between the HTTP front end and the engine core: typed messages, packed as msgpack by msgspec.

Front end to core (the request queue, ``ToCore``): ``Add`` a request, ``Abort`` one, ``Call`` a control call
between steps (``CALLS``), ``Shutdown``. Core to front end (the output queue, ``ToFrontEnd``): ``Ready`` once,
with the protocol version, the engine's facts, its usage and adapters; ``Outputs`` once a step (every output of
the step in one message, as token deltas); ``Rejected`` for a request ``add_request`` refused; ``Reply`` to a
call; ``Failed`` when the core stops. Each message is a msgpack array whose first element is its tag; every
field is checked against its type as it is read, so a message of another shape is refused by name, never half
read. No pickled objects: lists, maps, strings, bytes and numbers (an image's pixels as their float32 bytes).

``PROTOCOL`` numbers the messages' layout; the front end refuses a core that announces another (a replica or
core process started from a different lmport install). A new request field is one field on ``EngineRequest``
(or on ``GenerationConfig``, which travels as its map); both sides read it by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np

from lmport.config import GenerationConfig
from lmport.engine.outputs import ErrorKind, FinishReason, RequestError, RequestOutput
from lmport.lora import AdapterError
from lmport.lora.table import LoadedAdapter
from lmport.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from lmport.engine.core import EngineCore

PROTOCOL = 2   # raised whenever a message's layout or a field's meaning changes

# The control calls the core runs between steps (EngineCore methods); each replies with a LoadedAdapter.
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
    group: str | None = None        # the client request it is one of several sequences of (EngineCore.add_request)


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
    mmproj: str | None = None   # the GGUF text model's mmproj file, whose metadata sizes its images

    @classmethod
    def of(cls, engine: EngineCore) -> EngineInfo:
        cfg = engine.config
        return cls(engine.model_name, engine.model_config.vocab_size, engine.model_config.hidden_size,
                   engine.session_len,
                   list(engine.eos_token_ids), cfg.max_batch_size, cfg.max_prefill_token_num,
                   engine.plan.num_blocks, cfg.device_type, cfg.dtype, cfg.quant_policy, cfg.kv_cache_dtype,
                   cfg.mmproj)


class WireError(msgspec.Struct, array_like=True):
    """An error for the other side: its type, its message, and a LoRA adapter error's status and param."""
    type: str
    message: str
    status: int = 400
    param: str = ""

    @classmethod
    def of(cls, exc: Exception) -> WireError:
        if isinstance(exc, AdapterError):
            return cls("AdapterError", str(exc), exc.status, exc.param)
        if isinstance(exc, RequestError):
            return cls("RequestError", str(exc))
        return cls(type(exc).__name__, f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        """An AdapterError as the core raised it; any other error as a RequestError with its message."""
        if self.type == "AdapterError":
            return AdapterError(self.message, self.param, self.status)
        return RequestError(self.message)


class OutputDelta(msgspec.Struct, array_like=True):
    """A step's output as its deltas: token ids and no text (the core makes none; the front end's output
    processor, lmport.engine.output_processor, decodes them)."""
    request_id: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: FinishReason | None
    error: str | None
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: list[dict[int, float]] | None
    embedding: list[float] | None
    error_kind: ErrorKind | None

    @classmethod
    def of(cls, out: RequestOutput) -> OutputDelta:
        return cls(out.request_id, out.delta_token_ids, out.delta_logprobs, out.finished, out.finish_reason,
                   out.error, out.prompt_tokens, out.cached_tokens, out.prompt_logprobs, out.embedding,
                   out.error_kind)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, [], "", self.token_ids, "", self.finished, self.finish_reason,
                             self.prompt_tokens, self.cached_tokens, error=self.error, delta_logprobs=self.logprobs,
                             prompt_logprobs=self.prompt_logprobs, embedding=self.embedding,
                             error_kind=self.error_kind)


# -- front end to core -------------------------------------------------------------------------------------
class Add(msgspec.Struct, tag="add", array_like=True):
    request: EngineRequest


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class Call(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    name: str
    args: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ToCore = Add | Abort | Call | Shutdown


# -- core to front end -------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    protocol: int   # first, so that a core of another version is told apart before anything else is read
    info: EngineInfo
    usage: dict[str, Any]
    adapters: list[LoadedAdapter]


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[OutputDelta]
    usage: dict[str, Any]
    failure: str | None   # what the core reports it cannot run (a tensor-parallel rank), else None


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    request_id: str
    error: WireError


class Reply(msgspec.Struct, tag="reply", array_like=True):
    call_id: int
    adapter: LoadedAdapter | None
    error: WireError | None


class Failed(msgspec.Struct, tag="failed", array_like=True):
    reason: str
    config: bool = False   # the engine refused its configuration: the front end reports it as a ConfigError


ToFrontEnd = Ready | Outputs | Rejected | Reply | Failed


class ProtocolMismatch(RuntimeError):
    """The engine core speaks another version of these messages."""


def _encode_hook(obj: object) -> object:
    if isinstance(obj, np.ndarray):   # an image's pixel values: its shape and float32 bytes
        return [list(obj.shape), np.ascontiguousarray(obj, "<f4").tobytes()]
    raise NotImplementedError(f"{type(obj).__name__} does not cross to the engine core")


def _decode_hook(kind: type, obj: object) -> object:
    if kind is np.ndarray and isinstance(obj, list) and len(obj) == 2 and isinstance(obj[1], bytes):
        return np.frombuffer(obj[1], "<f4").reshape(obj[0])
    raise NotImplementedError(f"{kind.__name__} does not cross from the front end")


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
_to_core = msgspec.msgpack.Decoder(ToCore, dec_hook=_decode_hook)
_to_front_end = msgspec.msgpack.Decoder(ToFrontEnd, dec_hook=_decode_hook)

T = TypeVar("T")


def pack(message: object) -> bytes:
    """A message (or any value of the types above) as msgpack bytes."""
    return _encoder.encode(message)


def unpack(data: bytes, kind: type[T]) -> T:
    """``data`` read as ``kind``; msgspec.ValidationError naming the field that does not fit."""
    return msgspec.msgpack.decode(data, type=kind, dec_hook=_decode_hook)


def to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def to_front_end(data: bytes) -> ToFrontEnd:
    return _to_front_end.decode(data)


def ready(data: bytes) -> Ready | Failed:
    """The core's first message: Ready, or Failed when its engine could not start. ProtocolMismatch when the core
    announces another protocol (checked before the rest of the message is read)."""
    head = msgspec.msgpack.decode(data)
    if isinstance(head, list) and len(head) > 1 and head[0] == "ready" and head[1] != PROTOCOL:
        raise ProtocolMismatch(f"the engine core speaks protocol {head[1]}, this front end {PROTOCOL}: run both "
                               f"from the same lmport install")
    message = to_front_end(data)
    if not isinstance(message, Ready | Failed):
        raise ProtocolMismatch(f"the engine core's first message is {type(message).__name__}, not Ready")
    return message
