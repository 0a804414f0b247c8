"""The completion routes, POST /v1/chat/completions and POST /v1/completions (docs/server.md).

Each is one straight sequence: parse and validate the body, check and tokenize the prompt, map the request to a job,
admit it, then stream or collect its outputs in OpenAI's shapes (``lmport.server.openai_mapping``,
``lmport.server.streaming``). ``chat_prompt`` is also the way in for Anthropic's messages and OpenAI's responses,
which translate into a chat request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Request

from lmport.multimodal.fetch import allowed_url, fetch_all
from lmport.multimodal.images import ImageError, check_count, data_url_bytes, is_http_url
from lmport.server import access_log, openai_mapping, streaming, structured, tools
from lmport.server.auth import AUTH
from lmport.reasoning import Reasoning
from lmport.server.frontend import Frontend
from lmport.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, ImagePart, brief


async def chat_completions(frontend: Frontend, request: Request):
    """POST /v1/chat/completions."""
    received = time.perf_counter()
    req: ChatCompletionRequest = await frontend.parse(request, ChatCompletionRequest)
    prompt = await chat_prompt(frontend, req)
    job = openai_mapping.chat_job(frontend, req, prompt.ids, prompt.response_format, received,
                                  key=getattr(request.state, "api_key", None))
    job.images = prompt.images
    frontend.admit(job)
    reply = openai_mapping.ChatReply(frontend.tokenizer, job, req, prompt.tools, prompt.reasoning)
    chunks, body = access_log.counting_chunks(reply.chunks), access_log.counting_body(reply.body)
    return await streaming.respond(
        frontend, request, job, lambda: streaming.event_lines(frontend, job, chunks, reply.usage_chunk), body,
        stream=req.stream)


async def completions(frontend: Frontend, request: Request):
    """POST /v1/completions."""
    received = time.perf_counter()
    req: CompletionRequest = await frontend.parse(request, CompletionRequest)
    prompt = await completion_prompt(frontend, req)
    job = openai_mapping.completion_job(frontend, req, prompt.ids, prompt.response_format, received,
                                        key=getattr(request.state, "api_key", None))
    frontend.admit(job)
    reply = openai_mapping.CompletionReply(frontend.tokenizer, job, req, prompt.given)
    chunks, body = access_log.counting_chunks(reply.chunks), access_log.counting_body(reply.body)
    return await streaming.respond(
        frontend, request, job, lambda: streaming.event_lines(frontend, job, chunks, reply.usage_chunk), body,
        stream=req.stream)


@dataclass
class ChatPrompt:
    """A checked chat request made ready for the engine: what chat completions, Anthropic's messages and
    OpenAI's responses (which translate into a chat request) all hand the engine."""
    ids: list[int]                       # the conversation through the chat template, with its tools
    tools: tools.ToolSetup | None        # the callable tools (None: no call is parsed from the reply)
    response_format: dict | None         # the structured-output format, or the grammar forcing a call
    reasoning: Reasoning | None = None   # where the reply's thinking is (None: no separation)
    images: list | None = None           # the prompt's images (lmport.multimodal.inputs.ImageInput), None: none


async def chat_prompt(frontend: Frontend, req: ChatCompletionRequest) -> ChatPrompt:
    """Check a chat request's messages, tools and response_format (a 400 naming the field) and tokenize it."""
    if not req.messages:
        raise APIError(400, "messages: the list is empty; give at least one message", param="messages")
    if (chars := sum(len(m.text()) for m in req.messages)) > frontend.max_prompt_chars:
        raise _too_long(frontend, "messages", chars)
    image_parts = [(f"messages.{i}.content.{j}", part) for i, m in enumerate(req.messages) for j, part in m.images()]
    processor = await _image_processor(frontend, req) if image_parts else None
    setup = await structured.off_loop(frontend, tools.check, req, frontend.grammars,
                                      frontend.tool_parser or "hermes") if req.tools or req.tool_choice else None
    try:
        ids, text = await frontend.tokenize(tools.encode_text, frontend.tokenizer, req, setup)
    except APIError:
        raise
    except Exception as exc:  # a chat template may refuse a conversation (e.g. roles out of order)
        raise APIError(400, f"messages: the chat template refused them: {brief(str(exc), 300)}",
                       param="messages") from None
    images = None
    if processor is not None:
        ids, images = await _prompt_images(frontend, processor, ids, image_parts)
    response_format, format_param = structured.request_format(req)
    await structured.check_format(frontend, response_format, format_param)
    if setup is not None and (setup.response_format is not None or structured.constrains(response_format)):
        # A forced call is generated in its own grammar (the format is for text turns); with tool_choice auto, the
        # reply is a call or the format's output.
        response_format = await structured.off_loop(frontend, tools.turn_format, response_format, setup)
        await structured.check_format(frontend, response_format, "tools")
    reasoning = frontend.reasoning_of(text)
    if reasoning is not None and not (setup is not None and setup.forced_spans_reasoning):
        response_format = reasoning.gated(response_format, frontend.tokenizer)
    return ChatPrompt(ids, setup, response_format, reasoning, images)


async def _image_processor(frontend: Frontend, req: ChatCompletionRequest):
    """The model's image processor for a request with images: a 400 for a model that takes none, or an image
    outside a user message."""
    for i, m in enumerate(req.messages):
        if m.images() and m.role != "user":
            j = m.images()[0][0]
            raise APIError(400, f"messages.{i}.content.{j}: images belong in user messages",
                           param=f"messages.{i}.content.{j}")
    processor = await frontend.tokenize(frontend.image_processor)
    if processor is None:
        raise APIError(400, f"messages: model {frontend.model_name!r} takes no images; send text only, or serve a "
                            f"vision-language model (docs/vision.md)", param="messages")
    return processor


async def _prompt_images(frontend: Frontend, processor, ids: list[int],
                         parts: list[tuple[str, ImagePart]]) -> tuple[list[int], list]:
    """The prompt with its image placeholders expanded, and its images fetched (http(s) URLs, from the allowed hosts
    only), decoded and processed (off the event loop, one request's images at a time); a 400 naming the image for
    one the server cannot take."""
    limits = frontend.image_limits
    wheres = [f"{where}.image_url.url" for where, _ in parts]
    urls = [part.image_url.url for _, part in parts]

    def prepare(fetched: dict[int, bytes]):
        raw = [fetched[k] if k in fetched else data_url_bytes(url, where)
               for k, (url, where) in enumerate(zip(urls, wheres))]
        return processor.prepare(ids, raw, limits, wheres)
    try:
        check_count(len(parts), limits, "messages")   # before any image is fetched or decoded
        remote = [k for k, url in enumerate(urls) if is_http_url(url)]
        for k in remote:   # every URL checked against the allow-list before any is fetched
            allowed_url(urls[k], limits, wheres[k])
        fetched = await fetch_all([(urls[k], wheres[k]) for k in remote], limits) if remote else []
        return await frontend.tokenize(prepare, dict(zip(remote, fetched)))
    except ImageError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


@dataclass
class CompletionPrompt:
    """A checked completions request's prompts made ready for the engine."""
    given: list[str | list[int]]         # each prompt as the request gave it (text or token ids)
    ids: list[list[int]]                 # each prompt's token ids
    response_format: dict | None         # the structured-output format


async def completion_prompt(frontend: Frontend, req: CompletionRequest) -> CompletionPrompt:
    """Check a completions request's prompts, echo and response_format (a 400 naming the field) and tokenize."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: the list is empty; give a string or token ids", param="prompt")
    limit = frontend.limits.max_engine_requests
    if len(prompt) * req.n > limit:
        raise APIError(400, f"prompt: {len(prompt)} prompts x n={req.n} would be {len(prompt) * req.n} "
                            f"generations; the server allows at most {limit} per request "
                            f"(--max-engine-requests-per-request): send fewer prompts or a smaller n",
                       param="prompt")
    for p in prompt:
        if isinstance(p, str) and len(p) > frontend.max_prompt_chars:
            raise _too_long(frontend, "prompt", len(p))
    ids = await frontend.tokenize(
        lambda: [frontend.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt])
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens: 0 generates nothing; it is allowed only with echo (to score the "
                            "prompt)", param="max_tokens")
    if req.echo and req.stream:
        raise APIError(400, "echo: not supported with stream; send echo without stream", param="echo")
    response_format, format_param = structured.request_format(req)
    await structured.check_format(frontend, response_format, format_param)
    return CompletionPrompt(prompt, ids, response_format)


def _too_long(frontend: Frontend, param: str, chars: int) -> APIError:
    return APIError(400, f"{param}: {chars} characters is more than the server's limit of "
                         f"{frontend.max_prompt_chars} (--max-prompt-chars; the session holds "
                         f"{frontend.info.session_len} tokens): shorten it", param=param)


router = APIRouter(dependencies=AUTH)


@router.post("/v1/chat/completions")
async def chat_completions_route(request: Request):
    return await chat_completions(request.app.state.frontend, request)


@router.post("/v1/completions")
async def completions_route(request: Request):
    return await completions(request.app.state.frontend, request)
