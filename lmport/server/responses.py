"""OpenAI's Responses API, its stateless part: POST /v1/responses and POST /v1/responses/input_tokens
(docs/server.md).

A request is validated by the models below (an error names the field in OpenAI's shape), translated into a
chat completions request (instructions, input as a string or items: messages of text and images, function calls
and their outputs; function tools, tool_choice, text.format, max_output_tokens, sampling) and run through the chat
path (lmport.server.routes.chat_prompt). The output comes back as a Response object (message and function_call
items), or streamed as the API's events: response.created, response.in_progress, then per item
response.output_item.added, its content part or arguments deltas and their done events, response.output_item.done,
and last response.completed (response.incomplete when max_output_tokens cut it, response.failed on an error).

Nothing is stored: ``previous_response_id`` (and everything else that needs a stored response or conversation)
is refused with a 400 that says to send the whole conversation in ``input``.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, ClassVar, Literal, cast

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lmport.engine.outputs import RequestOutput
from lmport.server import access_log, openai_mapping, routes, streaming
from lmport.server.auth import AUTH
from lmport.server.protocol import (APIError, ChatCompletionRequest, JSONPathRequest, Unimplemented, _Request,
                                    bounded_int, empty_arguments)
from lmport.server.frontend import Frontend, Job
from lmport.server.replies import pieces, renamed, reply_calls, reply_thinking
from lmport.server.shapes import (ArgumentsDeltaEvent, ArgumentsDoneEvent, ContentPartEvent, FunctionCallOutput,
                                  InputTokensCount, ItemStatus, MessageOutput, OutputItem, OutputItemEvent,
                                  ReasoningOutput, ReplyOutputText, ResponseLifecycle, ResponseObject,
                                  ResponseStatus, ResponseStreamEvent, ResponseUsage, StreamError, TextDeltaEvent,
                                  TextDoneEvent)
from lmport.server.streaming import event


# -- requests ---------------------------------------------------------------------------------------------

class InputText(_Request):
    type: Literal["input_text"]
    text: str


class OutputText(_Request):
    type: Literal["output_text"]                  # an earlier assistant message's text
    text: str


class Refusal(_Request):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Request):
    """An image in a user message, run as a chat request's ``image_url`` part (docs/vision.md)."""
    type: Literal["input_image"]
    image_url: str | None = None                  # a data: URL, or an http(s) URL on an allowed host
    file_id: str | None = None                    # a stored file: refused, nothing is stored
    # Accepted and ignored: the model's image processor sizes every image (docs/vision.md, "Sending images").
    detail: Literal["auto", "low", "high", "original"] | None = None


class UnsupportedPart(_Request):
    type: Literal["input_file", "input_audio"]


Part = Annotated[InputText | OutputText | Refusal | InputImage | UnsupportedPart, Field(discriminator="type")]


class MessageItem(_Request):
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Request):
    type: Literal["function_call"]                # a call the model made earlier
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str

    _no_arguments = field_validator("arguments")(empty_arguments)


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]         # the result of that call
    call_id: str = Field(min_length=1)
    output: str | list[Part]


class UnsupportedItem(_Request):
    """Items of the API that need stored state, hosted tools or reasoning this server does not have: refused."""
    type: Literal["item_reference", "file_search_call", "web_search_call", "computer_call",
                  "computer_call_output", "image_generation_call", "code_interpreter_call", "local_shell_call",
                  "local_shell_call_output", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
                  "mcp_call", "custom_tool_call", "custom_tool_call_output"]


class ReasoningItem(_Request):
    """An earlier turn's reasoning (as a client sends a response's output back): left out of the prompt, as
    chat templates leave earlier turns' thinking out."""
    type: Literal["reasoning"]


Item = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | UnsupportedItem,
                 Field(discriminator="type")]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None                    # accepted; a forced call always follows the parameters

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data):
        if isinstance(data, dict) and data.get("type") != "function":
            raise PydanticCustomError("hosted_tool", "'{kind}' tools are hosted by OpenAI; this server runs "
                                                     "function tools (type, name, description, parameters)",
                                      {"kind": data.get("type")})
        return data


class ToolChoiceFunction(_Request):
    type: Literal["function"]
    name: str


class FormatText(_Request):
    type: Literal["text"]


class FormatJsonObject(_Request):
    type: Literal["json_object"]


class FormatJsonSchema(_Request):
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    json_schema: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None                    # accepted; the schema is always enforced


class TextConfig(_Request):
    format: Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")] | None = None


STORED = ("previous_response_id", "conversation", "prompt")   # fields that need stored state: refused

# Fields of the Responses API that change what a request asks for and that this server does not implement: refused
# (docs/server.md, "Unknown fields"); the stored-state ones above and the rest it defines are handled by name below.
UNIMPLEMENTED = {
    "context_management": Unimplemented("context management (compaction) of a stored conversation"),
    "moderation": Unimplemented("moderation of the input and output"),
    "personality": Unimplemented("a model-owned style preset"),
}


class _ResponsesInput(JSONPathRequest):
    """What a response and an input-token count request share: the conversation the model reads."""
    model_config = ConfigDict(extra="allow")
    UNIMPLEMENTED = UNIMPLEMENTED
    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    text: TextConfig | None = None
    parallel_tool_calls: bool = True              # accepted; a forced call is one call
    reasoning: dict | None = None                 # accepted; the model writes no separate reasoning
    truncation: Literal["auto", "disabled"] = "disabled"
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    top_k: ClassVar[int] = 0                      # Frontend.parse checks every request's top_k

    @model_validator(mode="before")
    @classmethod
    def _messages_typed(cls, data):
        """An input item with a role and no type is a message (the API's "easy" input message)."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [{**item, "type": "message"} if isinstance(item, dict) and "type" not in item
                                      and "role" in item else item for item in data["input"]]}
        return data

    def unsupported_problem(self) -> APIError | None:
        for name in STORED:
            if (value := getattr(self, name, None)) is not None:
                code = "previous_response_not_found" if name == "previous_response_id" else None
                return APIError(400, f"{name}: this server does not store responses or conversations, so "
                                     f"{value!r} cannot be used; send the whole conversation in input", param=name,
                                code=code)
        if self.truncation == "auto":
            return APIError(400, 'truncation: "auto" is not supported (the conversation is never cut); leave it '
                                 'out or send "disabled"', param="truncation")
        return None

    def stop_problem(self) -> APIError | None:
        return None

    def token_bias(self, vocab: int) -> None:
        return None


class ResponsesRequest(_ResponsesInput):
    """POST /v1/responses."""
    ROUTE = "/v1/responses"
    max_output_tokens: int | None = bounded_int(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    store: bool = True                            # accepted; nothing is stored (the response says store: false)
    metadata: dict[str, str] | None = None        # returned as given
    user: str | None = None
    include: list[str] | None = None              # accepted; there is nothing more to include
    top_logprobs: int | None = bounded_int(None, ge=0, le=20)
    background: bool = False
    prompt: dict | None = None

    def unsupported_problem(self) -> APIError | None:
        if (problem := super().unsupported_problem()) is not None:
            return problem
        if self.background:
            return APIError(400, "background: not supported (a background response is stored to be polled); "
                                 "leave it out", param="background")
        if self.top_logprobs:
            return APIError(400, "top_logprobs: not supported on /v1/responses; leave it out", param="top_logprobs")
        return None


class InputTokensRequest(_ResponsesInput):
    """POST /v1/responses/input_tokens: the input a response request would give the model, counted."""
    ROUTE = "/v1/responses/input_tokens"
    # What the chat request it stands for needs and a count does not take.
    temperature: ClassVar[float] = 1.0
    top_p: ClassVar[float] = 1.0
    max_output_tokens: ClassVar[int | None] = None


# -- the request as a chat request ----------------------------------------------------------------------------

def _check_parts(content: list, where: str, images: bool) -> None:
    """A 400 for a part this server does not read, or an image where ``images`` is false."""
    for k, part in enumerate(content):
        if isinstance(part, UnsupportedPart):
            raise APIError(400, f"{where}.{k}.type: {part.type!r} is not supported: this server's model reads "
                                f"text (input_text, output_text) and images (input_image)", param=f"{where}.{k}.type")
        if isinstance(part, InputImage) and not images:
            raise APIError(400, f"{where}.{k}: images belong in user messages; put the image in one",
                           param=f"{where}.{k}")


def _plain(part: InputText | OutputText | Refusal) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


def _text(content: str | list, where: str) -> str:
    if isinstance(content, str):
        return content
    _check_parts(content, where, images=False)
    return "".join(_plain(part) for part in content)


def _content(item: MessageItem, where: str) -> tuple[str | list[dict], list[int]]:
    """A message's content as a chat message's (its text, or with images its parts in order), and the index in
    ``item.content`` of each image part."""
    content = item.content
    images = [] if isinstance(content, str) else [k for k, part in enumerate(content) if isinstance(part, InputImage)]
    if not images or item.role != "user":
        return _text(content, where), []
    _check_parts(cast(list, content), where, images=True)
    parts: list[dict] = []
    for k, part in enumerate(cast(list, content)):
        if isinstance(part, InputImage):
            if part.file_id is not None:
                raise APIError(400, f"{where}.{k}.file_id: this server stores no files; send the image as image_url "
                                    f"(a data: URL)", param=f"{where}.{k}.file_id")
            if part.image_url is None:
                raise APIError(400, f"{where}.{k}.image_url: missing; send the image as a data: URL "
                                    f"(data:image/png;base64,...)", param=f"{where}.{k}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            parts.append({"type": "text", "text": _plain(part)})
    return parts, images


def to_chat(req: ResponsesRequest | InputTokensRequest) -> tuple[ChatCompletionRequest, dict[str, str]]:
    """The chat completions request ``req`` stands for, and the field of each image part there
    (``messages.M.content.J``) by its field here (``input.I.content.K``)."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    image_fields: dict[str, str] = {}
    items = req.input if isinstance(req.input, list) else [MessageItem(type="message", role="user",
                                                                       content=req.input)]
    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, UnsupportedItem):
            why = ("it refers to a stored item, and this server stores none: send the item itself"
                   if item.type == "item_reference" else "this server runs function tools and text messages")
            raise APIError(400, f"{where}.type: {item.type!r} items are not supported: {why}", param=f"{where}.type")
        if isinstance(item, MessageItem):
            content, images = _content(item, f"{where}.content")
            image_fields.update({f"messages.{len(messages)}.content.{k}": f"{where}.content.{k}" for k in images})
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            try:
                arguments = json.loads(item.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(400, f"{where}.arguments: must be a JSON object as text, got {item.arguments[:80]!r}",
                               param=f"{where}.arguments")
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{where}.output")})
    chat: dict = {"model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
                  "max_tokens": req.max_output_tokens}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, ToolChoiceFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if isinstance(fmt, FormatJsonObject):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, FormatJsonSchema):
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.json_schema, "strict": bool(fmt.strict)}}
    return ChatCompletionRequest.model_validate(chat), image_fields


def _field(param: str) -> str:
    """A chat request's field as the Responses API names it."""
    if param == "messages" or param.startswith("messages."):
        return "input"
    param = re.sub(r"^response_format(\.json_schema)?", "text.format", param)
    param = param.replace("tool_choice.function.name", "tool_choice.name").replace(".function.parameters",
                                                                                   ".parameters")
    return re.sub(r"^(tools\.\d+)\.function$", r"\1", param)


# -- the route ------------------------------------------------------------------------------------------------

async def create(frontend: Frontend, request: Request):
    """POST /v1/responses."""
    received = time.perf_counter()
    req: ResponsesRequest = await frontend.parse(request, ResponsesRequest)
    prompt, chat = await _prompt(frontend, req)
    try:
        job = openai_mapping.job_for(frontend, chat, [prompt.ids], "input", req.max_output_tokens, None, received,
                                     prompt.response_format, key=getattr(request.state, "api_key", None))
    except APIError as exc:
        raise renamed(exc, _field) from None
    job.images = prompt.images
    frontend.admit(job)
    reply = _Reply(frontend, job, prompt, req)
    return await streaming.respond(frontend, request, job, reply.events,
                                   access_log.counting_body(lambda outs: reply.body(outs[0])), stream=req.stream)


async def _prompt(frontend: Frontend,
                  req: ResponsesRequest | InputTokensRequest) -> tuple[routes.ChatPrompt, ChatCompletionRequest]:
    """The chat prompt ``req`` stands for and its chat request, with errors named as this API names them."""
    if isinstance(req.input, list) and not req.input:
        raise APIError(400, "input: the list is empty; give a string or at least one item", param="input")
    chat, image_fields = to_chat(req)

    def field(param: str) -> str:   # an image's field (and what follows it) as this API names it
        head = re.match(r"messages\.\d+\.content\.\d+", param)
        if head is None or head.group() not in image_fields:
            return _field(param)
        rest = param[head.end():]
        return image_fields[head.group()] + (".image_url" if rest == ".image_url.url" else rest)
    try:
        prompt = await routes.chat_prompt(frontend, chat)
    except APIError as exc:
        raise renamed(exc, field) from None
    return prompt, chat


async def input_tokens(frontend: Frontend, request: Request) -> InputTokensCount:
    """POST /v1/responses/input_tokens: the input's tokens as the model would read it, tools included."""
    req: InputTokensRequest = await frontend.parse(request, InputTokensRequest)
    prompt, _ = await _prompt(frontend, req)
    return {"object": "response.input_tokens", "input_tokens": len(prompt.ids)}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Reply:
    """One job's output as a Response object, or as the API's stream of events."""

    def __init__(self, frontend: Frontend, job: Job, prompt: routes.ChatPrompt, req: ResponsesRequest):
        self.frontend, self.job, self.tools, self.req = frontend, job, prompt.tools, req
        self.reasoning = prompt.reasoning   # the model's thinking comes back as a reasoning item
        self.sequence = 0   # the next event's sequence_number

    def response(self, status: ResponseStatus, output: list[OutputItem], out: RequestOutput | None = None,
                 error: dict | None = None) -> ResponseObject:
        req = self.req
        usage: ResponseUsage | None = None
        if out is not None:
            thinking = self.reasoning.token_count(out.token_ids, self.frontend.tokenizer) if self.reasoning else 0
            usage = {"input_tokens": out.prompt_tokens, "input_tokens_details": {"cached_tokens": out.cached_tokens},
                     "output_tokens": len(out.token_ids), "output_tokens_details": {"reasoning_tokens": thinking},
                     "total_tokens": out.prompt_tokens + len(out.token_ids)}
        fmt = req.text.format if req.text and req.text.format else FormatText(type="text")
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, ToolChoiceFunction) else \
            req.tool_choice or "auto"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": f"resp_{self.job.id}", "object": "response", "created_at": self.job.created, "status": status,
                "error": error, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.frontend.model_name, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": req.temperature, "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": choice, "tools": [t.model_dump() for t in req.tools or []], "top_p": req.top_p,
                # "auto" is refused (unsupported_problem)
                "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {}}

    @staticmethod
    def _status(out: RequestOutput) -> Literal["incomplete", "completed"]:
        return "incomplete" if out.finish_reason == "length" else "completed"

    @staticmethod
    def _message(text: str, status: ItemStatus, item_id: str | None = None) -> MessageOutput:
        return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
                status != "in_progress" else []}

    @staticmethod
    def _reasoning(text: str, status: ItemStatus) -> ReasoningOutput:
        return {"type": "reasoning", "id": _id("rs"), "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}

    def body(self, out: RequestOutput) -> ResponseObject:
        text, calls = reply_calls(out, self.tools, self.reasoning)
        thought = reply_thinking(out, self.reasoning)
        status = self._status(out)
        output: list[OutputItem] = [self._reasoning(thought, status)] if thought is not None else []
        output += [self._message(text, status)] if text or not calls else []
        output += [self._call(c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
        return self.response(status, output, out)

    @staticmethod
    def _call(name: str, arguments: str, status: ItemStatus) -> FunctionCallOutput:
        return {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": name,
                "arguments": arguments, "status": status}

    # Each event is built with the sequence number it is sent with (``self.sequence``), then sent (``_send``).

    def _send(self, data: ResponseStreamEvent) -> str:
        self.sequence += 1
        return event(data["type"], data)

    def _close(self, item: OutputItem, index: int, status: ItemStatus, text: str) -> list[str]:
        """The events that end an open output item (its text or arguments whole, then the item)."""
        lines = []
        if item["type"] == "reasoning":
            done: TextDoneEvent = {"type": "response.reasoning_text.done", "sequence_number": self.sequence,
                                   "item_id": item["id"], "output_index": index, "content_index": 0, "text": text}
            lines.append(self._send(done))
            item["content"] = [{"type": "reasoning_text", "text": text}]
        elif item["type"] == "message":
            part: ReplyOutputText = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = {"type": "response.output_text.done", "sequence_number": self.sequence, "item_id": item["id"],
                    "output_index": index, "content_index": 0, "text": text, "logprobs": []}
            lines.append(self._send(done))
            part_done: ContentPartEvent = {"type": "response.content_part.done", "sequence_number": self.sequence,
                                           "item_id": item["id"], "output_index": index, "content_index": 0,
                                           "part": part}
            lines.append(self._send(part_done))
            item["content"] = [part]
        else:
            arguments: ArgumentsDoneEvent = {"type": "response.function_call_arguments.done",
                                             "sequence_number": self.sequence, "item_id": item["id"],
                                             "output_index": index, "name": item["name"],
                                             "arguments": item["arguments"]}
            lines.append(self._send(arguments))
        item["status"] = status
        item_done: OutputItemEvent = {"type": "response.output_item.done", "sequence_number": self.sequence,
                                      "output_index": index, "item": item}
        lines.append(self._send(item_done))
        return lines

    def _open(self, item: OutputItem, output: list[OutputItem]) -> list[str]:
        output.append(item)
        index = len(output) - 1
        added: OutputItemEvent = {"type": "response.output_item.added", "sequence_number": self.sequence,
                                  "output_index": index, "item": item}
        lines = [self._send(added)]
        if item["type"] == "message":
            part_added: ContentPartEvent = {"type": "response.content_part.added", "sequence_number": self.sequence,
                                            "item_id": item["id"], "output_index": index, "content_index": 0,
                                            "part": {"type": "output_text", "text": "", "annotations": []}}
            lines.append(self._send(part_added))
        return lines

    def _lifecycle(self, kind: Literal["response.created", "response.in_progress", "response.completed",
                                       "response.incomplete", "response.failed"], response: ResponseObject) -> str:
        lifecycle: ResponseLifecycle = {"type": kind, "sequence_number": self.sequence, "response": response}
        return self._send(lifecycle)

    async def events(self):
        yield self._lifecycle("response.created", self.response("in_progress", []))
        yield self._lifecycle("response.in_progress", self.response("in_progress", []))
        output: list[OutputItem] = []
        item: OutputItem | None = None    # the output item being streamed (the last of output)
        text = ""                         # its text so far, when it is a message
        final = None
        delta: TextDeltaEvent
        try:
            async for new, out in pieces(self.frontend, self.job, self.tools, self.reasoning):
                access_log.note_output(0, out.token_ids)
                for piece in new:
                    kind = {"text": "message", "thinking": "reasoning"}.get(piece.kind, "function_call")
                    if piece.kind == "call" or item is None or item["type"] != kind:
                        if item is not None:
                            for line in self._close(item, len(output) - 1, "completed", text):
                                yield line
                        item = self._message("", "in_progress") if kind == "message" else \
                            self._reasoning("", "in_progress") if kind == "reasoning" else \
                            self._call(piece.text, "", "in_progress")
                        text = ""
                        for line in self._open(item, output):
                            yield line
                    if piece.kind == "thinking":
                        text += piece.text
                        delta = {"type": "response.reasoning_text.delta", "sequence_number": self.sequence,
                                 "item_id": item["id"], "output_index": len(output) - 1, "content_index": 0,
                                 "delta": piece.text}
                        yield self._send(delta)
                    elif piece.kind == "text":
                        text += piece.text
                        delta = {"type": "response.output_text.delta", "sequence_number": self.sequence,
                                 "item_id": item["id"], "output_index": len(output) - 1, "content_index": 0,
                                 "delta": piece.text, "logprobs": []}
                        yield self._send(delta)
                    elif piece.kind == "arguments":
                        if item["type"] != "function_call":   # pieces() opens a call before its arguments
                            raise RuntimeError(f"arguments for an open {item['type']} item")
                        item["arguments"] += piece.text
                        arguments: ArgumentsDeltaEvent = {
                            "type": "response.function_call_arguments.delta", "sequence_number": self.sequence,
                            "item_id": item["id"], "output_index": len(output) - 1, "delta": piece.text}
                        yield self._send(arguments)
                if out.finished:
                    final = out
        except Exception as caught:   # a timeout, shutdown, failed generation or bug: an error event, response.failed
            exc = streaming.stream_error(caught)
            error: StreamError = {"type": "error", "sequence_number": self.sequence, "code": exc.code or exc.type,
                                  "message": exc.message, "param": exc.param}
            yield self._send(error)
            yield self._lifecycle("response.failed", self.response(
                "failed", output, error={"code": exc.code or exc.type, "message": exc.message}))
            return
        if final is None:   # outputs() ends only once the choice has finished
            raise RuntimeError("the engine's output stream ended before the response's choice finished")
        status = self._status(final)
        if item is not None and item["type"] == "reasoning":   # only thinking: closed, then the empty message
            for line in self._close(item, len(output) - 1, status, text):
                yield line
            item, text = None, ""
        if item is None:   # nothing was said: one empty message, as the reply body has
            item = self._message("", "in_progress")
            for line in self._open(item, output):
                yield line
        for line in self._close(item, len(output) - 1, status, text):
            yield line
        yield self._lifecycle("response.incomplete" if status == "incomplete" else "response.completed",
                              self.response(status, output, final))


router = APIRouter(dependencies=AUTH)


@router.post("/v1/responses")
async def create_route(request: Request):
    return await create(request.app.state.frontend, request)


@router.post("/v1/responses/input_tokens")
async def input_tokens_route(request: Request):
    return await input_tokens(request.app.state.frontend, request)
