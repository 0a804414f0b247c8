"""The server's OpenAPI document: every route with its request body, its responses and their schemas.

The completion routes read their bodies themselves (size limit, body timeout, errors that name the
field), so FastAPI cannot see the request models; this module puts them, and the response shapes the
routes build, into the document. The ``model`` field lists the one model this server serves, so a
schema-driven client (or test generator) sends a name the server knows.
"""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, RootModel

from lmport.structured_output.grammar import MAX_ENUM_VALUES
from lmport.server.adapters import LoadLoraAdapter, UnloadLoraAdapter
from lmport.server.anthropic import CountTokensRequest, MessagesRequest
from lmport.server.embeddings import EmbeddingRequest
from lmport.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, ChatCompletionRequest, CompletionRequest
from lmport.server.responses import InputTokensRequest, ResponsesRequest
from lmport.server.tokenize import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"


class Shape(BaseModel):
    """An answer's shape, closed: tests/test_server_schema.py checks every route's answers against these, so an
    answer with a field the document does not declare fails there."""
    model_config = ConfigDict(extra="forbid")


class ErrorBody(Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Shape):
    error: ErrorBody


class ModelCard(Shape):
    """OpenAI's model object with Anthropic's fields beside it (type, display_name, created_at), so both APIs'
    clients read it; a LoRA adapter's card names its base model (parent) and, where the server shows paths, root."""
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    type: Literal["model"]
    display_name: str
    created_at: str
    chat_template: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    parent: str | None = None
    root: str | None = None


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelCard]
    has_more: bool
    first_id: str
    last_id: str


class Health(Shape):
    status: str
    reason: str | None = None
    since: str | None = None   # an engine core not progressing: when it last finished a step (ISO 8601, UTC)
    replicas: list[dict] | None = None   # a data-parallel server: each replica's state


class PromptTokensDetails(Shape):
    cached_tokens: int


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ReplyFunction(Shape):
    name: str
    arguments: str


class ReplyToolCall(Shape):
    id: str
    type: Literal["function"]
    function: ReplyFunction


class ToolCallDelta(Shape):
    """A streamed call: its first delta has the id, the type and the function's name; later ones pieces of its
    arguments."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ReplyFunction | dict


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[TokenLogprob] | None


class AssistantMessage(Shape):
    """``reasoning_content`` (and ``reasoning``, vLLM's newer name for the same text): a reasoning model's thinking,
    apart from its answer."""
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ReplyToolCall] | None = None


class ChatChoice(Shape):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None


class ChatCompletion(Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Shape):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Shape):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(Shape):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Shape):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: CompletionLogprobs | None


class Completion(Shape):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(Shape):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None


class CompletionChunk(Shape):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


# -- Anthropic's Messages API (lmport.server.anthropic) ----------------------------------------------------------

class AnthropicErrorBody(Shape):
    type: str
    message: str


class AnthropicError(Shape):
    type: Literal["error"]
    error: AnthropicErrorBody
    request_id: str | None = None


class ReplyTextBlock(Shape):
    type: Literal["text"]
    text: str


class ReplyThinkingBlock(Shape):
    """A reasoning model's thinking (its signature is empty: nothing here signs it)."""
    type: Literal["thinking"]
    thinking: str
    signature: str


class ReplyToolUseBlock(Shape):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


AnthropicBlock = Annotated[ReplyTextBlock | ReplyThinkingBlock | ReplyToolUseBlock, Field(discriminator="type")]


class AnthropicUsage(Shape):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class AnthropicMessage(Shape):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class MessageTokensCount(Shape):
    input_tokens: int


class MessageStart(Shape):
    type: Literal["message_start"]
    message: AnthropicMessage


class Ping(Shape):
    type: Literal["ping"]


class ContentBlockStart(Shape):
    type: Literal["content_block_start"]
    index: int
    content_block: AnthropicBlock


class TextDelta(Shape):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(Shape):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(Shape):
    type: Literal["input_json_delta"]
    partial_json: str


class ContentBlockDelta(Shape):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStop(Shape):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(Shape):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None


class MessageDelta(Shape):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: AnthropicUsage


class MessageStop(Shape):
    type: Literal["message_stop"]


class AnthropicStreamEvent(RootModel):
    """One event's data; ``type`` is also the event's name."""
    root: Annotated[MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
                    | MessageStop | AnthropicError, Field(discriminator="type")]


# -- OpenAI's Responses API (lmport.server.responses) --------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ReplyOutputText(Shape):
    type: Literal["output_text"]
    text: str
    annotations: list[dict]
    logprobs: list[dict] | None = None   # empty: the Responses API's logprobs are not supported


class ReasoningText(Shape):
    type: Literal["reasoning_text"]
    text: str


class MessageOutput(Shape):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[ReplyOutputText]


class ReasoningOutput(Shape):
    """A reasoning model's thinking, as its text (no summary is made)."""
    type: Literal["reasoning"]
    id: str
    status: ItemStatus
    summary: list[dict]
    content: list[ReasoningText]


class FunctionCallOutput(Shape):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[MessageOutput | ReasoningOutput | FunctionCallOutput, Field(discriminator="type")]


class TokenDetails(Shape):
    reasoning_tokens: int


class ResponseUsage(Shape):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: TokenDetails
    total_tokens: int


class ReasoningSettings(Shape):
    effort: str | None
    summary: str | None


class ResponseObject(Shape):
    """The response; the request's settings are echoed back as the Responses API does."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict | None
    incomplete_details: dict | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None
    reasoning: ReasoningSettings
    store: Literal[False]
    temperature: float | None
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    top_p: float | None
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None


class _Event(Shape):
    sequence_number: int


class ResponseLifecycle(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: ReplyOutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict] | None = None


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict] | None = None


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


class StreamError(_Event):
    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


class ResponseStreamEvent(RootModel):
    """One event's data; ``type`` is also the event's name."""
    root: ResponseLifecycle | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent \
        | ArgumentsDeltaEvent | ArgumentsDoneEvent | StreamError


class TokenizeResponse(Shape):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None   # with return_token_strs


class DetokenizeResponse(Shape):
    prompt: str


class InputTokensCount(Shape):
    object: Literal["response.input_tokens"]
    input_tokens: int


ERRORS = {
    400: "invalid request: the message names the field and the fix",
    401: "missing or wrong API key",
    404: "unknown model",
    408: "the request body did not arrive within --body-timeout",
    413: "the request body is larger than the server's limit",
    415: "the body is not application/json",
    421: "the Host header is not served here",
    403: "not allowed on this server (loading LoRA adapters is off)",
    409: "conflicts with the server's state (an adapter of that name is loaded, or in use)",
    500: "generation failed inside the engine for this request",
    503: "the server is busy (Retry-After), shutting down, or its engine has stopped",
    504: "not finished within --request-timeout",
}


def _stream(chunk: str) -> dict:
    """text/event-stream: OpenAPI before 3.2 has ``schema`` describe one event, as a client parses it."""
    return {"schema": {
        "type": "object", "required": ["data"],
        "description": "server-sent events: one `data: {chunk}` event per piece, an error object if the request "
                       "fails midway, then `data: [DONE]`",
        "properties": {
            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
            "data": {"anyOf": [{"const": "[DONE]"}, {
                "type": "string", "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [{"$ref": REF.format(model=chunk)},
                                            {"$ref": REF.format(model="ErrorResponse")}]}}]}}}}


def _named_stream(event: str, error: str | None = None) -> dict:
    """text/event-stream of named events (``event: <type>``), as Anthropic's and the Responses API's streams."""
    data = {"$ref": REF.format(model=event)} if error is None else {
        "anyOf": [{"$ref": REF.format(model=event)}, {"$ref": REF.format(model=error)}]}
    return {"schema": {
        "type": "object", "required": ["event", "data"],
        "description": "server-sent events, each `event: <type>` with `data: {json}` whose `type` is the same",
        "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
                       "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data}}}}


def _json(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": REF.format(model=name)}}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": ERRORS[s], "content": _json("ErrorResponse")} for s in statuses}


def below(n: int) -> str:
    """A regex of the decimal numbers 0 .. n - 1, without leading zeros."""
    digits = str(n - 1)
    parts = [f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):   # numbers of len(digits) digits up to n - 1: a prefix, then a smaller digit
        low = "1" if i == 0 else "0"
        if int(d) > int(low):
            rest = len(digits) - i - 1
            parts.append(f"{digits[:i]}[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    parts.append(digits)
    return "^(0|" + "|".join(parts) + ")$"


def build(app: FastAPI, model_name: str, api_key: bool, vocab: int) -> dict:
    """The OpenAPI document of ``app``."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="lmport's OpenAI-compatible API, Anthropic's Messages API and OpenAI's Responses API "
                                  "(docs/server.md)")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for cls in (ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard, ModelList, Health,
                ChatCompletion, Completion, ChatCompletionChunk, CompletionChunk, MessagesRequest, CountTokensRequest,
                ResponsesRequest, AnthropicError, AnthropicMessage, MessageTokensCount, AnthropicStreamEvent,
                ResponseObject, ResponseStreamEvent, EmbeddingRequest, LoadLoraAdapter, UnloadLoraAdapter,
                TokenizeRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse, InputTokensRequest,
                InputTokensCount):
        schema = cls.model_json_schema(ref_template=REF)
        for name, definition in {**schema.pop("$defs", {}), cls.__name__: schema}.items():
            # One name, one schema: a request's model and an answer's may not share a name.
            if schemas.setdefault(name, definition) != definition:
                raise ValueError(f"two schemas are named {name}: rename one of the models")
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [model_name], "description": "the served model (GET /v1/models)"}
        # What the routes check beyond the models' types (each a 400 naming the field).
        props["stop"]["anyOf"] = [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                                  {"type": "array", "maxItems": MAX_STOP_STRINGS,
                                   "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                                  {"type": "null"}]
        props["top_k"]["anyOf"][0]["maximum"] = vocab
        bias = props["logit_bias"]["anyOf"][0]
        bias["propertyNames"] = {"pattern": below(vocab)}
        # Refused unless absent (unsupported_problem): the document says so instead of offering any value.
        for name in ("functions", "function_call"):
            props[name] = {"type": "null", "description": "not supported; leave it out"}
        props["best_of"] = {"anyOf": [{"const": 1}, {"type": "null"}], "description": "only 1 (use n)"}
    schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] = 1
    # Only assistant messages carry tool_calls; a tool message names the call it answers.
    schemas["ChatMessage"]["anyOf"] = [
        {"properties": {"role": {"enum": ["system", "developer", "user"]}, "tool_calls": {"type": "null"}}},
        {"properties": {"role": {"const": "assistant"}}},
        {"properties": {"role": {"const": "tool"}, "tool_calls": {"type": "null"},
                        "tool_call_id": {"type": "string", "minLength": 1}},
         "required": ["tool_call_id"]}]
    props = schemas["CompletionRequest"]["properties"]
    token = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    props["prompt"]["anyOf"] = [{"type": "string", "minLength": 1},
                                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                                {"type": "array", "minItems": 1, "items": token},
                                {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                                                           "items": token}}]
    props["guided_grammar"]["anyOf"][0]["minLength"] = 1
    props["guided_choice"]["anyOf"][0].update(minItems=1, maxItems=MAX_ENUM_VALUES)
    props["guided_choice"]["anyOf"][0]["items"]["minLength"] = 1
    auth = (401,) if api_key else ()
    common = (*auth, 400, 404, 408, 413, 415, 421, 500, 503, 504)
    paths = doc["paths"]
    for path, request, response in (("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion"),
                                    ("/v1/completions", "CompletionRequest", "Completion")):
        op = paths[path]["post"]
        op["requestBody"] = {"required": True, "content": _json(request)}
        op["responses"] = {"200": {"description": "the completion, or with stream: true its chunks as events",
                                   "content": {**_json(response), "text/event-stream": _stream(response + "Chunk")}},
                           **_errors(*common)}
    for name in ("MessagesRequest", "CountTokensRequest", "ResponsesRequest", "EmbeddingRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [model_name],
                                                "description": "the served model (GET /v1/models)"}
    schemas["MessageItem"]["required"].remove("type")   # an input message may leave its type out
    props = schemas["ResponsesRequest"]["properties"]
    for name in ("previous_response_id", "conversation", "prompt"):   # refused: nothing is stored
        props[name] = {"type": "null", "description": "not supported (this server stores nothing); leave it out"}
    props["background"] = {"anyOf": [{"const": False}, {"type": "null"}], "description": "only false"}
    props["truncation"] = {"anyOf": [{"const": "disabled"}, {"type": "null"}], "description": "only disabled"}
    props["top_logprobs"] = {"anyOf": [{"const": 0}, {"type": "null"}], "description": "not supported"}
    anthropic_errors = {str(s): {"description": ERRORS[s], "content": _json("AnthropicError")} for s in common}
    paths["/v1/messages"]["post"].update(
        requestBody={"required": True, "content": _json("MessagesRequest")},
        responses={"200": {"description": "the message, or with stream: true its events",
                           "content": {**_json("AnthropicMessage"),
                                       "text/event-stream": _named_stream("AnthropicStreamEvent")}},
                   **anthropic_errors})
    paths["/v1/messages/count_tokens"]["post"].update(
        requestBody={"required": True, "content": _json("CountTokensRequest")},
        responses={"200": {"description": "the prompt's tokens", "content": _json("MessageTokensCount")},
                   **anthropic_errors})
    paths["/v1/responses"]["post"].update(
        requestBody={"required": True, "content": _json("ResponsesRequest")},
        responses={"200": {"description": "the response, or with stream: true its events",
                           "content": {**_json("ResponseObject"), "text/event-stream": _named_stream(
                               "ResponseStreamEvent")}},
                   **_errors(*common)})
    # A body is required (without one: 415); the replies are objects (docs/embeddings.md, docs/lora.md).
    for path, request, statuses in (("/v1/embeddings", "EmbeddingRequest", common),
                                    ("/v1/load_lora_adapter", "LoadLoraAdapter", (*common, 403, 409)),
                                    ("/v1/unload_lora_adapter", "UnloadLoraAdapter", (*common, 403, 409))):
        if path in paths:
            paths[path]["post"].update(
                requestBody={"required": True, "content": _json(request)},
                responses={"200": {"description": "the result", "content": {"application/json": {
                    "schema": {"type": "object"}}}}, **_errors(*statuses)})
    for path, request, response in (("/tokenize", "TokenizeRequest", "TokenizeResponse"),
                                    ("/detokenize", "DetokenizeRequest", "DetokenizeResponse"),
                                    ("/v1/responses/input_tokens", "InputTokensRequest", "InputTokensCount")):
        if path in paths:
            paths[path]["post"].update(requestBody={"required": True, "content": _json(request)},
                                       responses={"200": {"description": "the result", "content": _json(response)},
                                                  **_errors(*common)})
    paths["/v1/models"]["get"]["responses"] = {"200": {"description": "the served model",
                                                       "content": _json("ModelList")}, **_errors(*auth)}
    paths["/v1/models/{model_id}"]["get"]["responses"] = {"200": {"description": "the served model",
                                                                  "content": _json("ModelCard")},
                                                          **_errors(*auth, 404)}
    health = {"description": "ok; 503 with the reason when it cannot serve", "content": _json("Health")}
    paths["/health"]["get"]["responses"] = {"200": health, "503": health}
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors(*auth)}
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path != "/health":
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
