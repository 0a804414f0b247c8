"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens (docs/server.md).

A request is validated by the models below (Anthropic's rules; an error names the field), translated into a
chat completions request (system prompt, text, tool_use and tool_result blocks, tools, tool_choice,
stop_sequences, sampling) and run through the chat path (lmport.server.routes.chat_prompt: the chat template,
the tool prompt, call parsing, forced calls). The output comes back as a Message, or as Anthropic's stream of
events: message_start, ping, content_block_start/delta/stop per text or tool_use block, message_delta (stop
reason and usage), message_stop. Errors have Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``, on these routes whatever raised them (lmport.server.app).
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, ClassVar, Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from lmport.engine.outputs import RequestOutput
from lmport.server import access_log, openai_mapping, routes, streaming
from lmport.server.auth import AUTH
from lmport.server.protocol import (MAX_STOP_CHARS, MAX_STOP_STRINGS, APIError, ChatCompletionRequest,
                                    JSONPathRequest, Unimplemented, _Request, bounded_int)
from lmport.server.frontend import Frontend, Job
from lmport.server.replies import pieces, renamed, reply_calls, reply_thinking, stop_sequence
from lmport.server.shapes import (AnthropicBlock, AnthropicError, AnthropicErrorBody, AnthropicMessage, AnthropicUsage,
                                  BlockDelta, ContentBlockDelta, ContentBlockStart, ContentBlockStop, MessageDelta,
                                  MessageStart, MessageStop, MessageTokensCount, Ping, StopReason)
from lmport.server.streaming import event

PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

# Anthropic's error type for each status (docs: "HTTP errors"); its 529 overloaded is lmport's 503.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 504: "timeout_error"}


def error_body(exc: APIError) -> AnthropicError:
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    error: AnthropicErrorBody = {"type": kind, "message": exc.message}
    if exc.details:
        error["details"] = exc.details
    return {"type": "error", "error": error, "request_id": access_log.request_id() or f"req_{uuid.uuid4().hex}"}


# Fields of Anthropic's API that change what a request asks for and that this server does not implement: refused,
# as Anthropic refuses what it does not know (docs/server.md, "Unknown fields"). ``thread`` carries the error_code
# Anthropic's clients read to send the whole conversation again without one (the SDK's tool runner does).
UNIMPLEMENTED = {
    "thread": Unimplemented("server-held conversations", fix="send the whole conversation in messages, without thread",
                            details={"error_code": "thread_unsupported_request"}),
    "mcp_servers": Unimplemented("MCP servers, which Anthropic's servers call", fix="give their tools as custom tools"),
    "container": Unimplemented("code execution containers, which run on Anthropic's servers"),
    "context_management": Unimplemented("context editing", fix="send the conversation as the model should read it"),
    "compaction": Unimplemented("compaction requests"),
    "fallbacks": Unimplemented("fallback models"),
}


# -- requests ---------------------------------------------------------------------------------------------

class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict


class ImageSource(_Request):
    type: Literal["base64", "url", "file"]
    media_type: str | None = None                 # base64: image/png, image/jpeg, image/webp or image/gif
    data: str | None = None                       # base64: the image's bytes
    url: str | None = None                        # url: fetched from the allowed hosts only (docs/vision.md)
    file_id: str | None = None                    # file: refused (no Files API here)


class ImageBlock(_Request):
    """An image in a user message, sent to a vision-language model as an image_url part of the chat request (a
    data: URL, or the source's http(s) URL)."""
    type: Literal["image"]
    source: ImageSource


class UnsupportedBlock(_Request):
    """Blocks of Anthropic's API that a text model cannot read or that run on Anthropic's servers: refused."""
    type: Literal["document", "search_result", "server_tool_use", "web_search_tool_result",
                  "web_fetch_tool_result", "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                  "container_upload"]


ResultPart = Annotated[TextBlock | ImageBlock | UnsupportedBlock, Field(discriminator="type")]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] = ""
    is_error: bool = False


class ThinkingBlock(_Request):
    """An earlier turn's reasoning: left out of the prompt (as Anthropic leaves earlier turns' thinking out)."""
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | UnsupportedBlock,
                  Field(discriminator="type")]


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data):
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise PydanticCustomError(
                "server_tool", "'{kind}' is one of Anthropic's server tools, which run on Anthropic's servers; "
                               "this server runs custom tools (name, description, input_schema)",
                {"kind": data["type"]})
        return data


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None                       # the tool, with type "tool"
    disable_parallel_tool_use: bool = False       # accepted; a forced call is one call


class JSONOutputFormat(_Request):
    type: Literal["json_schema"]
    json_schema: dict = Field(alias="schema")


class OutputConfig(_Request):
    format: JSONOutputFormat | None = None        # structured output: the reply is JSON valid against the schema
    effort: str | None = None                     # accepted; changes nothing here


class _Conversation(JSONPathRequest):
    """What a messages and a count_tokens request share."""
    model_config = ConfigDict(extra="allow")
    UNIMPLEMENTED = UNIMPLEMENTED
    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict | None = None                  # accepted; a reasoning model's thinking comes back as thinking blocks

    def unsupported_problem(self) -> APIError | None:
        return None

    def stop_problem(self) -> APIError | None:
        return None

    def token_bias(self, vocab: int) -> None:
        return None


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens."""
    ROUTE = "/v1/messages/count_tokens"
    top_k: ClassVar[int] = 0                      # Frontend.parse checks every request's top_k


class MessagesRequest(_Conversation):
    """POST /v1/messages. Sampling bounds are Anthropic's (temperature 0 to 1)."""
    ROUTE = "/v1/messages"
    max_tokens: int = bounded_int(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = bounded_int(0, ge=0)             # 0: off
    metadata: dict | None = None                  # accepted (user_id), changes nothing
    output_config: OutputConfig | None = None

    def stop_problem(self) -> APIError | None:
        words = self.stop_sequences or []
        if len(words) > MAX_STOP_STRINGS:
            return APIError(400, f"stop_sequences: {len(words)} stop sequences; give at most {MAX_STOP_STRINGS}",
                            param="stop_sequences")
        for i, word in enumerate(words):
            if not word or len(word) > MAX_STOP_CHARS:
                return APIError(400, f"stop_sequences.{i}: give a stop sequence of 1 to {MAX_STOP_CHARS} characters "
                                     f"(got {len(word)})", param=f"stop_sequences.{i}")
        return None


# -- the request as a chat request ----------------------------------------------------------------------------

def _unsupported(where: str, kind: str) -> APIError:
    return APIError(400, f"{where}.type: {kind!r} blocks are not supported: this server's model reads text "
                         f"(text, tool_use and tool_result blocks)", param=f"{where}.type")


def _result_text(block: ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        for k, part in enumerate(block.content):
            if isinstance(part, UnsupportedBlock):
                raise _unsupported(f"{where}.content.{k}", part.type)
            if isinstance(part, ImageBlock):
                raise APIError(400, f"{where}.content.{k}: images in tool results are not supported; put the "
                                    f"image in the user message", param=f"{where}.content.{k}")
        text = "".join(part.text for part in block.content if isinstance(part, TextBlock))
    return f"Error: {text}" if block.is_error else text


def _chat_messages(i: int, message: MessageParam) -> tuple[list[dict], dict[int, str]]:
    """One Anthropic message as chat messages: tool_result blocks become tool messages (before the user's text),
    tool_use blocks an assistant's tool_calls. With them, the source field behind each image part of the last
    message (part index -> "messages.i.content.j.source.data" or ".url")."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}], {}
    text, calls, results, parts, images = [], [], [], [], {}
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, UnsupportedBlock):
            raise _unsupported(where, block.type)
        if isinstance(block, TextBlock):
            text.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            if message.role != "user":
                raise APIError(400, f"{where}: image blocks belong in user messages", param=where)
            images[len(parts)] = f"{where}.source.{'url' if block.source.type == 'url' else 'data'}"
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise APIError(400, f"{where}: tool_use blocks belong in assistant messages", param=where)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise APIError(400, f"{where}: tool_result blocks belong in user messages", param=where)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, where)})
    if message.role == "assistant":
        return [{"role": "assistant", "content": "".join(text) or None,
                 **({"tool_calls": calls} if calls else {})}], {}
    if images:   # images among the text: the parts in order
        return results + [{"role": "user", "content": parts}], images
    return results + [{"role": "user", "content": "".join(text)}] if text or not results else results, {}


def _image_url(block: ImageBlock, where: str) -> str:
    """An image block as the URL a chat request carries: a base64 source as a data: URL, a url source as it is
    (the chat route fetches it from the allowed hosts only, or refuses it)."""
    source = block.source
    if source.type == "url":
        if not source.url:
            raise APIError(400, f"{where}.source.url: a url image needs its url", param=f"{where}.source.url")
        return source.url
    if source.type != "base64":
        raise APIError(400, f"{where}.source.type: {source.type!r} images are not read by this server (no Files "
                            f"API); send the image as a base64 or url source", param=f"{where}.source.type")
    if not source.media_type or not source.data:
        raise APIError(400, f"{where}.source: a base64 image needs media_type and data", param=f"{where}.source")
    return f"data:{source.media_type};base64,{source.data}"


def to_chat(req: _Conversation) -> tuple[ChatCompletionRequest, str, dict[str, str]]:
    """The chat completions request ``req`` stands for, the text of a final assistant message, which the reply
    continues (Anthropic's prefill; "" when the last message is the user's), and each image part's place in the
    chat request ("messages.I.content.K") with the source field it came from ("messages.i.content.j.source.data")."""
    turns = list(req.messages)
    prefill = ""
    if turns and turns[-1].role == "assistant":
        last = turns.pop()
        if isinstance(last.content, list):
            for j, block in enumerate(last.content):
                if not isinstance(block, (TextBlock, ThinkingBlock)):
                    where = f"messages.{len(turns)}.content.{j}"
                    raise APIError(400, f"{where}: a final assistant message is continued by the reply (prefill) "
                                        f"and may hold only text blocks; end with a user message", param=where)
            prefill = "".join(b.text for b in last.content if isinstance(b, TextBlock))
        else:
            prefill = last.content
    messages = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
    image_blocks: dict[str, str] = {}
    for i, message in enumerate(turns):
        converted, images = _chat_messages(i, message)
        messages += converted
        image_blocks.update({f"messages.{len(messages) - 1}.content.{k}": source for k, source in images.items()})
    chat: dict = {"model": req.model, "messages": messages}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema, **({"description": t.description} if t.description else {})}}
            for t in req.tools]
    if (choice := req.tool_choice) is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, 'tool_choice.name: give the tool to call with type "tool"',
                               param="tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if isinstance(req, MessagesRequest):
        chat.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    stop=req.stop_sequences or None)
        if req.output_config is not None and req.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": req.output_config.format.json_schema}}
    return ChatCompletionRequest.model_validate(chat), prefill, image_blocks


def _field(param: str) -> str:
    """A chat request's field as Anthropic names it."""
    param = re.sub(r"^response_format(\.json_schema)?", "output_config.format", param)
    param = param.replace("tool_choice.function.name", "tool_choice.name").replace(".function.parameters",
                                                                                   ".input_schema")
    return param.replace(".function", ".name") if param.startswith("tools.") else param


async def _prompt(frontend: Frontend, req: _Conversation) -> tuple[routes.ChatPrompt, ChatCompletionRequest]:
    if not req.messages:
        raise APIError(400, "messages: the list is empty; give at least one message", param="messages")
    chat, prefill, image_blocks = to_chat(req)

    def field(param: str) -> str:   # an image's URL as this API names it: its block's source field
        head = re.match(r"messages\.\d+\.content\.\d+\.image_url\.url$", param)
        return image_blocks.get(param.removesuffix(".image_url.url"), param) if head else _field(param)
    try:
        prompt = await routes.chat_prompt(frontend, chat)
    except APIError as exc:
        raise renamed(exc, field) from None
    if prefill:   # the reply goes on from the assistant's text, after the template's opening of its turn
        tokenizer = frontend.tokenizer
        prompt.ids = prompt.ids + await frontend.tokenize(
            lambda: tokenizer.encode(prefill, add_special_tokens=False, split_special_tokens=True))
    return prompt, chat


# -- routes ---------------------------------------------------------------------------------------------------

async def count_tokens(frontend: Frontend, request: Request) -> MessageTokensCount:
    """POST /v1/messages/count_tokens: the prompt's tokens as the model would see it, tools included."""
    req = await frontend.parse(request, CountTokensRequest)
    prompt, _ = await _prompt(frontend, req)
    return {"input_tokens": len(prompt.ids)}


async def messages(frontend: Frontend, request: Request):
    """POST /v1/messages."""
    received = time.perf_counter()
    req: MessagesRequest = await frontend.parse(request, MessagesRequest)
    prompt, chat = await _prompt(frontend, req)
    job = openai_mapping.job_for(frontend, chat, [prompt.ids], "messages", req.max_tokens, None, received,
                                 prompt.response_format, key=getattr(request.state, "api_key", None))
    job.images = prompt.images
    frontend.admit(job)
    reply = _Reply(frontend, job, prompt, chat.stop_words)
    return await streaming.respond(frontend, request, job, reply.events,
                                   access_log.counting_body(lambda outs: reply.body(outs[0])), stream=req.stream)


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class _Reply:
    """One job's output as a Message, or as Anthropic's stream of events."""

    def __init__(self, frontend: Frontend, job: Job, prompt: routes.ChatPrompt, stop_words: list[str] | None):
        self.frontend, self.job, self.tools, self.stop_words = frontend, job, prompt.tools, stop_words
        self.reasoning = prompt.reasoning   # the model's thinking comes back as thinking blocks

    def _usage(self, out: RequestOutput) -> AnthropicUsage:
        # Anthropic counts the prompt tokens read from its cache apart from input_tokens.
        return {"input_tokens": out.prompt_tokens - out.cached_tokens, "output_tokens": len(out.token_ids),
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": out.cached_tokens}

    def _stop(self, out: RequestOutput, called: bool) -> tuple[StopReason, str | None]:
        """(stop_reason, stop_sequence)."""
        if out.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        word = stop_sequence(self.frontend.tokenizer, out, self.stop_words)
        return ("end_turn", None) if word is None else ("stop_sequence", word)

    def _message(self, content: list[AnthropicBlock], stop: tuple[StopReason | None, str | None],
                 usage: AnthropicUsage) -> AnthropicMessage:
        return {"id": f"msg_{self.job.id}", "type": "message", "role": "assistant", "model": self.frontend.model_name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def body(self, out: RequestOutput) -> AnthropicMessage:
        text, calls = reply_calls(out, self.tools, self.reasoning)
        thought = reply_thinking(out, self.reasoning)
        thinking: list[AnthropicBlock] = [{"type": "thinking", "thinking": thought, "signature": ""}] \
            if thought is not None else []
        said: list[AnthropicBlock] = [{"type": "text", "text": text}] if text else []
        uses: list[AnthropicBlock] = [{"type": "tool_use", "id": _tool_id(), "name": c["function"]["name"],
                                       "input": json.loads(c["function"]["arguments"])} for c in calls]
        return self._message(thinking + said + uses, self._stop(out, bool(calls)), self._usage(out))

    async def events(self):
        # Each event's data is annotated with its shape (lmport.server.shapes), which the type checker holds it to.
        usage: AnthropicUsage = {"input_tokens": len(self.job.prompts[0]), "output_tokens": 0,
                                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        start: MessageStart = {"type": "message_start", "message": self._message([], (None, None), usage)}
        yield event("message_start", start)
        ping: Ping = {"type": "ping"}
        yield event("ping", ping)
        index, open_kind, called, final = -1, None, False, None
        stop: ContentBlockStop
        try:
            async for new, out in pieces(self.frontend, self.job, self.tools, self.reasoning):
                access_log.note_output(0, out.token_ids)
                for piece in new:
                    kind = piece.kind if piece.kind in ("text", "thinking") else "tool_use"
                    if piece.kind == "call" or kind != open_kind:
                        if open_kind is not None:
                            stop = {"type": "content_block_stop", "index": index}
                            yield event("content_block_stop", stop)
                        index, open_kind = index + 1, kind
                        block: AnthropicBlock = {"type": "text", "text": ""} if kind == "text" else {
                            "type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {
                            "type": "tool_use", "id": _tool_id(), "name": piece.text, "input": {}}
                        called |= kind == "tool_use"
                        opened: ContentBlockStart = {"type": "content_block_start", "index": index,
                                                     "content_block": block}
                        yield event("content_block_start", opened)
                    if piece.kind != "call":
                        delta: BlockDelta = {"type": "text_delta", "text": piece.text} if kind == "text" else {
                            "type": "thinking_delta", "thinking": piece.text} if kind == "thinking" else {
                            "type": "input_json_delta", "partial_json": piece.text}
                        more: ContentBlockDelta = {"type": "content_block_delta", "index": index, "delta": delta}
                        yield event("content_block_delta", more)
                if out.finished:
                    final = out
        except Exception as exc:   # a timeout, shutdown, failed generation or bug: the stream ends with an error event
            yield event("error", error_body(streaming.stream_error(exc)))
            return
        if open_kind is not None:
            stop = {"type": "content_block_stop", "index": index}
            yield event("content_block_stop", stop)
        if final is not None:
            stop_reason, word = self._stop(final, called)
            ended: MessageDelta = {"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                      "stop_sequence": word},
                                   "usage": self._usage(final)}
            yield event("message_delta", ended)
        last: MessageStop = {"type": "message_stop"}
        yield event("message_stop", last)


router = APIRouter(dependencies=AUTH)


@router.post("/v1/messages")
async def messages_route(request: Request):
    return await messages(request.app.state.frontend, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens_route(request: Request):
    return await count_tokens(request.app.state.frontend, request)
