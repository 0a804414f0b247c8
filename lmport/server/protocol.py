"""Request models of the OpenAI API subset lmport serves, and OpenAI-style errors.

Requests are validated strictly (``"16"`` is not an int), so a wrong type is
an error that names its field instead of a silent coercion. A request body's
unknown top-level fields are never dropped silently: one that would change what
the request asks for (each route's ``UNIMPLEMENTED``) is a 400 naming it, any
other (``user``, ``service_tier``: clients send fields that do not change
generation) is accepted and logged once. Responses are plain dicts typed by their shapes
(``shapes.py``), built in ``openai_mapping.py`` (``anthropic.py`` and ``responses.py`` for their APIs).
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmport.server.shapes import ErrorResponse

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256          # each stop string is matched against the text's end at every token
REPETITION_PENALTY_RANGE = (0.01, 100.0)   # beyond it logits over- or underflow float32
MAX_LOGIT_BIAS, LOGIT_BIAS_LIMIT = 300, 100   # OpenAI's: at most 300 tokens, each biased by -100..100
# Every integer a request gives is bounded at validation, the same on every route, so that none reaches the
# engine's (msgpack) messages too big to pack: counts (tokens, choices, top_k, ...) fit in 32 bits, a seed in 64.
INT32_MAX = 2**31 - 1
SEED_RANGE = (-2**63, 2**64 - 1)


def bounded_int(default=..., *, ge: int = 0, le: int = INT32_MAX):
    """An integer field's bounds (``Field``): from ``ge`` to ``le``, at most INT32_MAX unless said otherwise."""
    return Field(default, ge=ge, le=le)


class APIError(Exception):
    """Becomes ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None,
                 details: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers
        self.details = details   # machine-readable cause, where an API defines one (Anthropic's error.details)

    def body(self) -> ErrorResponse:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(exc: ValidationError, body=None) -> APIError:
    """The first problem pydantic found, as a 400 that names the field. With the parsed ``body``, the names of
    tagged-union members (a content block's ``type``) are left out of the path, so it reads like the JSON."""
    errors = exc.errors(include_url=False)
    if body is not None:
        errors = [{**e, "loc": _json_path(e["loc"], body)} for e in errors]
    # A union field reports one error per member: the deepest one is the most specific.
    err = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    if err["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err['msg']}", code="invalid_json")
    if err["type"] == "model_type":  # the body is JSON but not an object
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    # Drop union-member tags ("str", "list[str]") so the path reads like the JSON: messages.0.content
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) or None
    got = brief(err.get("input"))
    if err["type"] in _BOUNDS:   # lmport's words for a number out of its field's bounds
        key, words = _BOUNDS[err["type"]]
        return APIError(400, f"{param}: out of range, give a value {words} {err.get('ctx', {}).get(key)} (got {got})",
                        param=param)
    message = f"{param}: {err['msg']}" + ("" if err["type"] == "missing" else f" (got {got})")
    return APIError(400, message, param=param)


_BOUNDS = {"greater_than_equal": ("ge", "of at least"), "greater_than": ("gt", "greater than"),
           "less_than_equal": ("le", "of at most"), "less_than": ("lt", "less than")}


def brief(value, limit: int = 80) -> str:
    """repr(value), cut to ``limit`` characters: an error message never echoes a huge input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


def _json_path(loc: tuple, body) -> tuple:
    """``loc`` without the tags pydantic adds for a discriminated union's member (the member's ``type``)."""
    path, node = [], body
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and node.get("type") == part:
            continue
        path.append(part)
        if _is_union_tag(part):   # a union member's name ("str", "list[...]"): not in the JSON
            continue
        if isinstance(node, dict) and isinstance(part, str) or isinstance(node, list) and isinstance(part, int) \
                and -len(node) <= part < len(node):
            node = node.get(part) if isinstance(node, dict) else node[part]
        else:
            node = None
    return tuple(path)


def _is_union_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "top_k", "seed", "logprobs", "top_logprobs", "best_of",
              "prompt")


def _integral(value):
    """A float with no fraction as an int, in nested lists too (token-id prompts); anything else unchanged."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list) and any(isinstance(v, (float, list)) for v in value):
        return [_integral(v) for v in value]
    return value


def _nullable_in_schema(schema: dict, cls) -> None:
    """The JSON schema says what the validator accepts: null wherever a field has a default."""
    for name, prop in schema.get("properties", {}).items():
        field = cls.model_fields.get(name)
        if field is None or field.is_required() or field.default is None or "anyOf" in prop and any(
                p.get("type") == "null" for p in prop["anyOf"]):
            continue
        default = prop.pop("default", field.default)
        title = prop.pop("title", None)
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], "default": default,
                                      **({"title": title} if title else {})}


@dataclass(frozen=True)
class Unimplemented:
    """A field of an API that lmport does not implement and that changes what a request asks for: given (not
    null, and not one of ``harmless`` values that ask for what lmport does anyway), it is a 400 naming it."""
    why: str                              # what the field asks for, that this server does not do
    harmless: tuple = ()
    fix: str = "leave it out"
    details: dict | None = None           # the API's machine-readable cause, for clients that branch on it

    def problem(self, name: str, value) -> APIError | None:
        if value is None or value in self.harmless:
            return None
        return APIError(400, f"{name}: not supported by this server ({self.why}); {self.fix}", param=name,
                        code="unsupported_parameter", details=self.details)


class UnknownFields:
    """Logs each unknown (accepted) top-level field once per route, so a client's extra fields are seen in the
    log without flooding it; at most ``limit`` names are remembered (a client can make up endless names)."""

    def __init__(self, limit: int = 1024):
        self.limit, self.seen, self.lock = limit, set(), threading.Lock()

    def note(self, route: str, names) -> None:
        for name in names:
            with self.lock:
                if (route, name) in self.seen or len(self.seen) >= self.limit:
                    continue
                self.seen.add((route, name))
            # A warning, so that it shows at the server's default log level: once per route and name.
            log.warning("%s: accepted and ignored the unknown field %s (it does not change the request)", route,
                        brief(name, 60))


unknown_fields = UnknownFields()


class _Request(BaseModel):
    """A request body. An explicit ``null`` means the field's default, as OpenAI treats it (the openai SDK sends
    null for every argument given as None)."""
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_nullable_in_schema)
    # A route's body (extra="allow"): its fields that lmport does not implement and that change the request's
    # meaning are refused; any other unknown field is accepted and logged once (docs/server.md, "Unknown fields").
    ROUTE: ClassVar[str] = ""
    UNIMPLEMENTED: ClassVar[Mapping[str, Unimplemented]] = {}

    def unknown_field_problem(self) -> APIError | None:
        """A 400 for the first given field of UNIMPLEMENTED; the other unknown fields are noted in the log."""
        extra = self.model_extra
        if not extra:
            return None
        for name, value in extra.items():
            rule = self.UNIMPLEMENTED.get(name)
            if rule is not None and (problem := rule.problem(name, value)) is not None:
                return problem
        unknown_fields.note(self.ROUTE, [name for name in extra if name not in self.UNIMPLEMENTED])
        return None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict) and any(v is None for v in data.values()):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}
        if isinstance(data, dict):
            # JSON has one number type: 2.0 is the integer 2 (JSON Schema's "integer" says so too), 2.5 stays an error.
            ints = [k for k in INT_FIELDS if isinstance(data.get(k), (float, list))]
            if ints:
                data = {**data, **{k: _integral(data[k]) for k in ints}}
        return data


class JSONPathRequest(_Request):
    """A request body whose errors name a field by its JSON path: a tagged union's member (a content block's
    ``type``, as Anthropic's and the Responses API's bodies have them) is not part of it."""

    @classmethod
    def model_validate_json(cls, json_data, **kwargs):
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as exc:
            try:
                body = json.loads(json_data)
            except (ValueError, RecursionError):   # lmport.server.jsonbody bounds the depth before this
                body = None
            raise validation_error(exc, body) from None


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False          # vLLM's extension: every chunk carries the usage so far


# vLLM's sampling extensions that lmport does not implement, refused on both completion routes unless they ask for
# what lmport does anyway.
VLLM_UNIMPLEMENTED = {
    "min_tokens": Unimplemented("vLLM's minimum output length", harmless=(0,)),
    "stop_token_ids": Unimplemented("vLLM's stop token ids", harmless=([],), fix="give stop strings in stop"),
    "bad_words": Unimplemented("vLLM's banned words", harmless=([],), fix="use logit_bias"),
    "allowed_token_ids": Unimplemented("vLLM's token allow-list", fix="use logit_bias or a structured output"),
    "prompt_logprobs": Unimplemented("vLLM's prompt logprobs", fix="use echo with logprobs on /v1/completions"),
    "truncate_prompt_tokens": Unimplemented("vLLM's prompt truncation", fix="shorten the prompt"),
    "include_stop_str_in_output": Unimplemented("vLLM's stop string kept in the text", harmless=(False,)),
    "skip_special_tokens": Unimplemented("vLLM's special tokens in the text", harmless=(True,)),
    "spaces_between_special_tokens": Unimplemented("vLLM's detokenizing switch", harmless=(True,)),
    "use_beam_search": Unimplemented("beam search", harmless=(False,)),
    "guided_whitespace_pattern": Unimplemented("vLLM's JSON whitespace pattern"),
    "return_tokens_as_token_ids": Unimplemented("vLLM's token ids as logprob tokens", harmless=(False,)),
    "return_token_ids": Unimplemented("vLLM's token ids in the reply", harmless=(False,)),
}


class _Sampling(_Request):
    """Fields shared by both routes. temperature 0 is greedy; > 0 samples (OpenAI's default is 1)."""
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = bounded_int(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = bounded_int(0, ge=-1)            # extension (vLLM, LMDeploy); 0 or -1: off
    min_p: float = Field(0.0, ge=0, lt=1)         # extension
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    presence_penalty: float = Field(0.0, ge=-2, le=2)   # OpenAI's, over generated tokens
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    n: int = bounded_int(1, ge=1, le=16)
    seed: int | None = bounded_int(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None           # checked in stop_problem() for messages that name the limit
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                      # extension: generate exactly max_tokens
    speculate: bool = True                        # extension: False opts out of the server's speculative decoding
    cache_salt: str | None = Field(None, min_length=1, max_length=256)   # vLLM's: keys the prefix-cache hash
    logit_bias: dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,8})$")],
                     Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)          # OpenAI's bounds; the ids are checked against the vocabulary
    # OpenAI fields lmport does not implement: refused (unsupported_problem) rather than silently ignored.
    best_of: int | None = bounded_int(None, ge=1)
    functions: list | None = None
    function_call: str | dict | None = None

    def unsupported_problem(self) -> APIError | None:
        if self.best_of is not None and self.best_of != 1:
            return APIError(400, "best_of: not supported by lmport (only 1); use n for several choices",
                            param="best_of")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                return APIError(400, f"{name}: not supported by lmport; leave it out", param=name)
        return None

    def token_bias(self, vocab: int) -> dict[int, float] | None:
        """logit_bias with int token ids; a 400 naming the entry for an id outside the vocabulary."""
        if not self.logit_bias:
            return None
        bias = {int(token): value for token, value in self.logit_bias.items()}
        for token in bias:
            if token >= vocab:
                raise APIError(400, f"logit_bias.{token}: token id {token} is outside the vocabulary (ids 0 to "
                                    f"{vocab - 1})", param="logit_bias")
        return bias

    def stop_problem(self) -> APIError | None:
        words = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(words) > MAX_STOP_STRINGS:
            return APIError(400, f"stop: {len(words)} stop strings; give at most {MAX_STOP_STRINGS}",
                            param="stop")
        for i, word in enumerate(words):
            where = "stop" if isinstance(self.stop, str) else f"stop.{i}"
            if not word:
                return APIError(400, f"{where}: an empty stop string would stop at once; leave it out",
                                param="stop")
            if len(word) > MAX_STOP_CHARS:
                return APIError(400, f"{where}: a stop string of {len(word)} characters; give at most "
                                     f"{MAX_STOP_CHARS}", param="stop")
        return None

    @property
    def stop_words(self) -> list[str] | None:
        if self.stop is None or self.stop == []:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str                                      # a data: URL (lmport.multimodal.images); http(s) is refused
    detail: Literal["auto", "low", "high"] | None = None   # accepted; the model's image processor sets the size


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def empty_arguments(text: str) -> str:
    """A call's arguments as JSON text, where blank text (clients send "" for a call without arguments) is {}."""
    return text if text.strip() else "{}"


class FunctionCall(_Request):
    name: str
    arguments: str                                # JSON text, as OpenAI sends it

    _no_arguments = field_validator("arguments")(empty_arguments)


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None      # an assistant's earlier calls
    tool_call_id: str | None = None               # a tool message: the call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def images(self) -> list[tuple[int, ImagePart]]:
        """(index in content, part) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]

    def template_content(self) -> str | list[dict]:
        """The content as the chat template takes it: the text, or with images its parts in order, an image as
        {"type": "image"} (where the model's template writes its placeholder)."""
        if not self.images():
            return self.text()
        return [{"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
                for part in cast(list, self.content)]


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs`` (its StructuredOutputsParams): one constraint, as the guided_* fields give it.
    A key it does not know is an error naming it, so nothing a client asks for is dropped."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None       # refused (lmport.server.structured): no structural tags here
    whitespace_pattern: str | None = None          # refused likewise: JSON is compiled without free whitespace
    disable_any_whitespace: bool = False           # accepted: lmport's JSON never has free whitespace
    disable_fallback: bool = False                 # accepted: there is no other grammar backend to fall back to
    disable_additional_properties: bool = False    # accepted: schemas are compiled strictly

    def constraints(self) -> list[tuple[str, Any]]:
        """(key, value) of each constraint given: vLLM requires exactly one."""
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return [(key, value) for key, value in given.items() if value is not None]


class _Structured(_Sampling):
    """Structured outputs: OpenAI's response_format, or vLLM's structured_outputs or one of its older guided_*
    fields, or llama.cpp's ``grammar`` / ``json_schema`` (the same as guided_grammar / guided_json);
    lmport.server.structured checks that at most one is given."""
    response_format: dict | None = None           # text, json_object, json_schema (structured_output)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    grammar: str | None = None
    json_schema: dict | None = None


class ChatCompletionRequest(_Structured):
    ROUTE = "/v1/chat/completions"
    UNIMPLEMENTED = {
        **VLLM_UNIMPLEMENTED,
        "audio": Unimplemented("audio output"),
        "modalities": Unimplemented("output other than text", harmless=(["text"],)),
        "web_search_options": Unimplemented("web search"),
        "moderation": Unimplemented("moderation of the input and output"),
        "chat_template": Unimplemented("a chat template of the request's own"),
        "documents": Unimplemented("documents given to the chat template"),
        "echo": Unimplemented("vLLM's echo of the last message", harmless=(False,)),
        "add_special_tokens": Unimplemented("vLLM's special tokens added to the prompt", harmless=(False,)),
    }
    messages: list[ChatMessage]
    max_completion_tokens: int | None = bounded_int(None, ge=1)  # the newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = bounded_int(None, ge=0, le=20)
    tools: list[dict] | None = None               # checked by lmport.server.tools
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat template switches: leave out the assistant turn's opening, or continue the last (assistant)
    # message in place, without closing its turn (a prefill the reply extends); at most one of them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: more variables for the chat template (enable_thinking: false turns Qwen3's thinking off)
    chat_template_kwargs: dict | None = None
    include_reasoning: bool = True                # vLLM's: false leaves the reasoning out of the reply


class CompletionRequest(_Structured):
    ROUTE = "/v1/completions"
    UNIMPLEMENTED = {
        **VLLM_UNIMPLEMENTED,
        "suffix": Unimplemented("text after the completion (fill-in-the-middle)", harmless=("",)),
        "add_special_tokens": Unimplemented("vLLM's special tokens added to the prompt", harmless=(True,)),
    }
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = bounded_int(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = bounded_int(None, ge=0, le=20)
    echo: bool = False                            # the prompt (and its logprobs) before the completion
