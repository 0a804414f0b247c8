"""The answers' shapes: every answer and stream event the routes send, as TypedDicts.

One declaration serves three purposes. The builders (``openai_mapping``, ``streaming``, ``anthropic``,
``responses``, ``tools``, ``tokenize``, ``service``) are annotated with these types, so the type checker holds
every dict they build to its shape, key by key, at no cost when they run: an answer is still a plain dict,
serialised by json's C encoder (``lmport.server.answers``). The OpenAPI document (``lmport.server.openapi``)
shows their schemas (``pydantic.TypeAdapter``); and ``tests/test_server_schema.py`` validates every route's
answers against them. Each is closed (``extra="forbid"``): a key the shape does not declare is refused.

``NotRequired[Annotated[X, ABSENT]]``: a key an answer may leave out, which the document says reads as null.
``Sequence``: a list the builder may hand as a lazy ``answers.Each``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, with_config
from typing_extensions import NotRequired, TypedDict

closed = with_config(ConfigDict(extra="forbid"))
ABSENT = Field(default=None)   # the document's ``"default": null`` for a key an answer may leave out


@closed
class ErrorBody(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


@closed
class ErrorResponse(TypedDict):
    error: ErrorBody


@closed
class ModelCard(TypedDict):
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
    chat_template: NotRequired[Annotated[str | None, ABSENT]]
    reasoning_parser: NotRequired[Annotated[str | None, ABSENT]]
    tool_call_parser: NotRequired[Annotated[str | None, ABSENT]]
    parent: NotRequired[Annotated[str | None, ABSENT]]
    root: NotRequired[Annotated[str | None, ABSENT]]


class OpenAICard(TypedDict):
    """A model card as OpenAI has it, before ``service.with_anthropic_fields`` adds Anthropic's fields (not in
    the document: every card the server sends has them)."""
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    chat_template: NotRequired[str | None]
    reasoning_parser: NotRequired[str | None]
    tool_call_parser: NotRequired[str | None]
    parent: NotRequired[str | None]
    root: NotRequired[str | None]


class ChatCard(TypedDict):
    """What a model card says of the server's chat format (lmport.server.chat_format)."""
    chat_template: str | None
    reasoning_parser: str | None
    tool_call_parser: str


@closed
class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]
    has_more: bool
    first_id: str
    last_id: str


@closed
class Health(TypedDict):
    status: str
    reason: NotRequired[Annotated[str | None, ABSENT]]
    # an engine core not progressing: when it last finished a step (ISO 8601, UTC)
    since: NotRequired[Annotated[str | None, ABSENT]]
    replicas: NotRequired[Annotated[list[dict] | None, ABSENT]]   # a data-parallel server: each replica's state


@closed
class PromptTokensDetails(TypedDict):
    cached_tokens: int


@closed
class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[Annotated[PromptTokensDetails | None, ABSENT]]


@closed
class ReplyFunction(TypedDict):
    name: str
    arguments: str


@closed
class ReplyToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ReplyFunction


@closed
class ToolCallDelta(TypedDict):
    """A streamed call: its first delta has the id, the type and the function's name; later ones pieces of its
    arguments."""
    index: int
    id: NotRequired[Annotated[str | None, ABSENT]]
    type: NotRequired[Annotated[Literal["function"] | None, ABSENT]]
    function: ReplyFunction | dict


@closed
class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None


@closed
class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


@closed
class ChatLogprobs(TypedDict):
    content: Sequence[TokenLogprob] | None


ChatFinish = Literal["stop", "length", "tool_calls"]


@closed
class AssistantMessage(TypedDict):
    """``reasoning_content`` (and ``reasoning``, vLLM's newer name for the same text): a reasoning model's thinking,
    apart from its answer."""
    role: Literal["assistant"]
    content: str | None
    reasoning_content: NotRequired[Annotated[str | None, ABSENT]]
    reasoning: NotRequired[Annotated[str | None, ABSENT]]
    tool_calls: NotRequired[Annotated[list[ReplyToolCall] | None, ABSENT]]


@closed
class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    finish_reason: ChatFinish
    logprobs: ChatLogprobs | None


@closed
class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: NotRequired[Annotated[str | None, ABSENT]]
    choices: Sequence[ChatChoice]
    usage: Usage


@closed
class ChatDelta(TypedDict):
    role: NotRequired[Annotated[Literal["assistant"] | None, ABSENT]]
    content: NotRequired[Annotated[str | None, ABSENT]]
    reasoning_content: NotRequired[Annotated[str | None, ABSENT]]
    reasoning: NotRequired[Annotated[str | None, ABSENT]]
    tool_calls: NotRequired[Annotated[list[ToolCallDelta] | None, ABSENT]]


@closed
class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    finish_reason: ChatFinish | None
    logprobs: ChatLogprobs | None


@closed
class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: NotRequired[Annotated[str | None, ABSENT]]
    choices: list[ChatChunkChoice]
    usage: NotRequired[Annotated[Usage | None, ABSENT]]


class ChatHeader(TypedDict):
    """What every chunk of a chat completion (and its whole answer, as another ``object``) starts with."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None


@closed
class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: Sequence[dict[str, float] | None]
    text_offset: list[int]


Finish = Literal["stop", "length"]


@closed
class CompletionChoice(TypedDict):
    index: int
    text: str
    finish_reason: Finish
    logprobs: CompletionLogprobs | None


@closed
class Completion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: NotRequired[Annotated[str | None, ABSENT]]
    choices: Sequence[CompletionChoice]
    usage: Usage


@closed
class CompletionChunkChoice(TypedDict):
    index: int
    text: str
    finish_reason: Finish | None
    logprobs: CompletionLogprobs | None


@closed
class CompletionChunk(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: NotRequired[Annotated[str | None, ABSENT]]
    choices: list[CompletionChunkChoice]
    usage: NotRequired[Annotated[Usage | None, ABSENT]]


class CompletionHeader(TypedDict):
    """What every chunk of a text completion, and its whole answer, starts with."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None


# -- Anthropic's Messages API (lmport.server.anthropic) ----------------------------------------------------------

@closed
class AnthropicErrorBody(TypedDict):
    type: str
    message: str
    details: NotRequired[dict]   # the API's machine-readable cause, where it defines one (APIError.details)


@closed
class AnthropicError(TypedDict):
    type: Literal["error"]
    error: AnthropicErrorBody
    request_id: NotRequired[Annotated[str | None, ABSENT]]


@closed
class ReplyTextBlock(TypedDict):
    type: Literal["text"]
    text: str


@closed
class ReplyThinkingBlock(TypedDict):
    """A reasoning model's thinking (its signature is empty: nothing here signs it)."""
    type: Literal["thinking"]
    thinking: str
    signature: str


@closed
class ReplyToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


AnthropicBlock = Annotated[ReplyTextBlock | ReplyThinkingBlock | ReplyToolUseBlock, Field(discriminator="type")]


@closed
class AnthropicUsage(TypedDict):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: NotRequired[Annotated[int | None, ABSENT]]
    cache_read_input_tokens: NotRequired[Annotated[int | None, ABSENT]]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


@closed
class AnthropicMessage(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


@closed
class MessageTokensCount(TypedDict):
    input_tokens: int


@closed
class MessageStart(TypedDict):
    type: Literal["message_start"]
    message: AnthropicMessage


@closed
class Ping(TypedDict):
    type: Literal["ping"]


@closed
class ContentBlockStart(TypedDict):
    type: Literal["content_block_start"]
    index: int
    content_block: AnthropicBlock


@closed
class TextDelta(TypedDict):
    type: Literal["text_delta"]
    text: str


@closed
class ThinkingDelta(TypedDict):
    type: Literal["thinking_delta"]
    thinking: str


@closed
class InputJsonDelta(TypedDict):
    type: Literal["input_json_delta"]
    partial_json: str


BlockDelta = Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


@closed
class ContentBlockDelta(TypedDict):
    type: Literal["content_block_delta"]
    index: int
    delta: BlockDelta


@closed
class ContentBlockStop(TypedDict):
    type: Literal["content_block_stop"]
    index: int


@closed
class StopDelta(TypedDict):
    stop_reason: StopReason | None
    stop_sequence: str | None


@closed
class MessageDelta(TypedDict):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: AnthropicUsage


@closed
class MessageStop(TypedDict):
    type: Literal["message_stop"]


AnthropicStreamEvent = Annotated[
    MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
    | AnthropicError,
    Field(discriminator="type", title="AnthropicStreamEvent",
          description="One event's data; ``type`` is also the event's name.")]


# -- OpenAI's Responses API (lmport.server.responses) --------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


@closed
class ReplyOutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[dict]
    logprobs: NotRequired[Annotated[list[dict] | None, ABSENT]]   # empty: the Responses API's logprobs are unsupported


@closed
class ReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


@closed
class MessageOutput(TypedDict):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[ReplyOutputText]


@closed
class ReasoningOutput(TypedDict):
    """A reasoning model's thinking, as its text (no summary is made)."""
    type: Literal["reasoning"]
    id: str
    status: ItemStatus
    summary: list[dict]
    content: list[ReasoningText]


@closed
class FunctionCallOutput(TypedDict):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[MessageOutput | ReasoningOutput | FunctionCallOutput, Field(discriminator="type")]


@closed
class TokenDetails(TypedDict):
    reasoning_tokens: int


@closed
class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: TokenDetails
    total_tokens: int


@closed
class ReasoningSettings(TypedDict):
    effort: str | None
    summary: str | None


ResponseStatus = Literal["completed", "incomplete", "in_progress", "failed"]


@closed
class ResponseObject(TypedDict):
    """The response; the request's settings are echoed back as the Responses API does."""
    id: str
    object: Literal["response"]
    created_at: int
    status: ResponseStatus
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


class _Event(TypedDict):
    sequence_number: int


@closed
class ResponseLifecycle(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


@closed
class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


@closed
class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: ReplyOutputText


@closed
class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: NotRequired[Annotated[list[dict] | None, ABSENT]]


@closed
class TextDoneEvent(_Event):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: NotRequired[Annotated[list[dict] | None, ABSENT]]


@closed
class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


@closed
class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


@closed
class StreamError(_Event):
    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


ResponseStreamEvent = Annotated[
    ResponseLifecycle | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent | ArgumentsDeltaEvent
    | ArgumentsDoneEvent | StreamError,
    Field(title="ResponseStreamEvent", description="One event's data; ``type`` is also the event's name.")]


@closed
class TokenizeResponse(TypedDict):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: NotRequired[Annotated[list[str] | None, ABSENT]]   # with return_token_strs


@closed
class DetokenizeResponse(TypedDict):
    prompt: str


@closed
class InputTokensCount(TypedDict):
    object: Literal["response.input_tokens"]
    input_tokens: int


@closed
class Embedding(TypedDict):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str   # the floats, or (encoding_format "base64") their little-endian float32 bytes


@closed
class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


@closed
class EmbeddingList(TypedDict):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


@closed
class LoadedAdapter(TypedDict):
    """A LoRA adapter just loaded: the name requests give as ``model``, and the base model it adapts."""
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: NotRequired[Annotated[str | None, ABSENT]]   # its path, where the server shows adapter paths
    parent: str


@closed
class UnloadedAdapter(TypedDict):
    id: str
    object: Literal["model"]
    deleted: Literal[True]
