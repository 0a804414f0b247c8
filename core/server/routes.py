"""The completion routes, POST /v1/chat/completions and POST /v1/completions (docs/server.md).

Each parses and checks its request, builds a job and admits it; ``respond`` then does what every route shares
(Anthropic's messages and OpenAI's responses too): stream the outputs as server-sent events, or wait for them
and answer once. ``chat_prompt`` is the chat request path those two translate into.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from lmport.engine import RequestOutput
from lmport.server import echo, structured, tools
from lmport.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, brief
from lmport.server.serving import EventStream, Frontend, Job, event_lines, finish_reason


def _too_long(server: Frontend, param: str, chars: int) -> APIError:
    return APIError(400, f"{param}: {chars} characters is more than the server's limit of {server.max_prompt_chars} "
                         f"(--max-prompt-chars; the session holds {server.info.session_len} tokens): shorten it",
                    param=param)


async def respond(server: Frontend, request: Request, job: Job, events: Callable[[], AsyncIterator[str]],
                  body: Callable[[list[RequestOutput]], dict], *, stream: bool):
    """An admitted job's reply: ``events()`` (server-sent event lines) as a stream, or ``body(final outputs)``
    once all are done; 499 when the client left first."""
    if stream:
        timeout = server.limits.request_timeout
        return EventStream(events(), on_close=job.release, headers={"Cache-Control": "no-cache"},
                           send_timeout=server.limits.send_timeout,
                           deadline=None if timeout is None else job.received + timeout)
    try:
        outs = await server.until_done_or_gone(request, job)
    finally:
        job.release()
    if outs is None:
        return Response(status_code=499)  # nobody is listening
    return body(outs)


@dataclass
class ChatPrompt:
    """A checked chat request made ready for the engine: what chat completions, Anthropic's messages and
    OpenAI's responses (which translate into a chat request) all hand the engine."""
    ids: list[int]                       # the conversation through the chat template, with its tools
    tools: tools.ToolSetup | None        # the callable tools (None: no call is parsed from the reply)
    response_format: dict | None         # the structured-output format, or the grammar forcing a call


async def chat_prompt(server: Frontend, req: ChatCompletionRequest) -> ChatPrompt:
    """Check a chat request's messages, tools and response_format (a 400 naming the field) and tokenize it."""
    if not req.messages:
        raise APIError(400, "messages: the list is empty; give at least one message", param="messages")
    if (chars := sum(len(m.text()) for m in req.messages)) > server.max_prompt_chars:
        raise _too_long(server, "messages", chars)
    setup = await structured.off_loop(server, tools.check, req, server.grammars) if req.tools or req.tool_choice \
        else None
    try:
        ids = await server.tokenize(tools.encode, server.tokenizer, req, setup)
    except APIError:
        raise
    except Exception as exc:  # a chat template may refuse a conversation (e.g. roles out of order)
        raise APIError(400, f"messages: the chat template refused them: {brief(str(exc), 300)}",
                       param="messages") from None
    response_format, format_param = structured.request_format(req)
    await structured.check_format(server, response_format, format_param)
    if setup is not None and setup.response_format is not None:
        if structured.constrains(response_format):
            raise APIError(400, f"{format_param}: cannot be combined with a tool_choice that forces a call",
                           param=format_param)
        response_format = setup.response_format
        await structured.check_format(server, response_format, "tools")
    return ChatPrompt(ids, setup, response_format)


async def chat_completions(server: Frontend, request: Request):
    """POST /v1/chat/completions."""
    received = time.perf_counter()
    req: ChatCompletionRequest = await server.parse(request, ChatCompletionRequest)
    prompt = await chat_prompt(server, req)
    setup = prompt.tools
    top = (req.top_logprobs or 0) if req.logprobs else None
    job = server.job(req, [prompt.ids], "messages", req.max_completion_tokens or req.max_tokens, top, received,
                     prompt.response_format, key=getattr(request.state, "api_key", None))
    job.header = {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created,
                  "model": req.model, "system_fingerprint": server.fingerprint}
    job.stream_usage(req.stream_options)
    server.admit(job)

    parsers = [tools.StreamParser(setup) for _ in job.configs] if setup and req.stream else None
    called = [False] * len(job.configs)
    started = [False] * len(job.configs)

    def chunk(choice, out, text, lp_from) -> list[dict]:
        """OpenAI's stream: the role alone first, then only non-empty deltas, then an empty delta with the
        finish reason. Logprobs go with the text they are of (text held back keeps them back too)."""
        def one(delta, finish, logprobs):
            return {**job.header, "choices": [{"index": choice, "delta": delta, "finish_reason": finish,
                                               "logprobs": logprobs}]}
        chunks = []
        if not started[choice]:
            started[choice] = True
            chunks.append(one({"role": "assistant", "content": None}, None, None))
        calls = []
        if parsers:
            text, calls = parsers[choice].feed(text, out.finished)
            called[choice] |= bool(calls)
        delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        logprobs = server.chat_logprobs(out, lp_from, top) if top is not None and (delta or out.finished) else None
        if delta:
            chunks.append(one(delta, None, logprobs))
        if out.finished:
            finish = finish_reason(out)
            chunks.append(one({}, "tool_calls" if finish == "stop" and called[choice] else finish,
                              None if delta else logprobs))
        return chunks

    def body(outs: list[RequestOutput]) -> dict:
        choices = []
        for c, o in enumerate(outs):
            message, finish = {"role": "assistant", "content": o.text}, finish_reason(o)
            if setup is not None:
                message["content"], calls = tools.parse(o.text, setup)
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c, "message": message, "finish_reason": finish,
                            "logprobs": server.chat_logprobs(o, 0, top) if top is not None else None})
        return {**job.header, "object": "chat.completion", "usage": server.usage(job, outs), "choices": choices}

    return await respond(server, request, job, lambda: event_lines(server, job, chunk), body,
                         stream=req.stream)


async def completions(server: Frontend, request: Request):
    """POST /v1/completions."""
    received = time.perf_counter()
    req: CompletionRequest = await server.parse(request, CompletionRequest)
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: the list is empty; give a string or token ids", param="prompt")
    limit = server.limits.max_engine_requests
    if len(prompt) * req.n > limit:
        raise APIError(400, f"prompt: {len(prompt)} prompts x n={req.n} would be {len(prompt) * req.n} "
                            f"generations; the server allows at most {limit} per request "
                            f"(--max-engine-requests-per-request): send fewer prompts or a smaller n",
                       param="prompt")
    for p in prompt:
        if isinstance(p, str) and len(p) > server.max_prompt_chars:
            raise _too_long(server, "prompt", len(p))
    prompts = await server.tokenize(
        lambda: [server.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt])
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens: 0 generates nothing; it is allowed only with echo (to score the "
                            "prompt)", param="max_tokens")
    if req.echo and req.stream:
        raise APIError(400, "echo: not supported with stream; send echo without stream", param="echo")
    response_format, format_param = structured.request_format(req)
    await structured.check_format(server, response_format, format_param)
    # echo with logprobs scores each prompt as the engine prefills it; with max_tokens 0 that is all it does.
    scoring = (req.logprobs or 0) if req.echo and (req.logprobs is not None or req.max_tokens == 0) else None
    job = server.job(req, prompts, "prompt", req.max_tokens, req.logprobs, received, response_format,
                     key=getattr(request.state, "api_key", None), prompt_logprobs=scoring)
    job.header = {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created,
                  "model": req.model, "system_fingerprint": server.fingerprint}
    job.stream_usage(req.stream_options)
    top = req.logprobs
    server.admit(job)
    if req.echo:
        texts = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in prompt]
        try:
            return await _echo_completion(server, req, job, top, request, texts)
        finally:
            job.release()

    def chunk(choice, out, text, lp_from) -> list[dict]:
        if not text and not out.finished:
            return []
        return [{**job.header, "choices": [{
            "index": choice, "text": text, "finish_reason": finish_reason(out),
            "logprobs": server.completion_logprobs(out, lp_from, top) if top is not None else None}]}]

    def body(outs: list[RequestOutput]) -> dict:
        return {**job.header, "usage": server.usage(job, outs), "choices": [
            {"index": c, "text": o.text, "finish_reason": finish_reason(o),
             "logprobs": server.completion_logprobs(o, 0, top) if top is not None else None}
            for c, o in enumerate(outs)]}

    return await respond(server, request, job, lambda: event_lines(server, job, chunk), body,
                         stream=req.stream)


async def _echo_completion(server: Frontend, req: CompletionRequest, job: Job, top: int | None, request: Request,
                           prompt_texts: list[str]):
    """The prompt (text and logprobs) before each choice's completion; only the prompt with max_tokens 0."""
    outs = await server.until_done_or_gone(request, job)
    if outs is None:
        return Response(status_code=499)
    choices = []
    for c, o in enumerate(outs):
        ids = job.prompt_of(c)
        generated = None if top is None else server.completion_logprobs(o, 0, top)
        scores = None if top is None else echo.prompt_scores(ids, o.prompt_logprobs or [])
        choices.append({"index": c, "text": prompt_texts[c // job.n] + o.text, "finish_reason": finish_reason(o),
                        "logprobs": echo.merge(server, ids, scores, top, generated)})
    return {**job.header, "choices": choices, "usage": server.usage(job, outs)}
