"""`lmport serve`: an OpenAI-compatible HTTP API over one Engine (FastAPI + uvicorn).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(``stream: true`` gives server-sent events ending in ``data: [DONE]``),
GET /health (never needs the API key) and GET /metrics (Prometheus).

The Engine runs in an EngineLoop thread; each HTTP request becomes one
engine request per choice (``n``). A client that goes away, streaming or
not, aborts its engine requests, which frees their KV blocks at once.
Bad input is refused before anything is queued, with an OpenAI-style error
that names the field; see docs/server.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmport.config import ConfigError, GenerationConfig
from lmport.engine import Engine, RequestError, RequestOutput
from lmport.engine_loop import EngineLoop, EngineStopped
from lmport.server.guards import Guards
from lmport.server.limits import Admission, Limits
from lmport.server import echo, structured, tools
from lmport.server.metrics import Metrics
from lmport.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, brief, validation_error

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 2 * 2**20


@dataclass
class _Job:
    """One HTTP generation request: its prompts and one GenerationConfig per choice."""
    id: str
    created: int
    prompts: list[list[int]]
    configs: list[GenerationConfig]   # len(prompts) * n, choice index = prompt index * n + sample index
    n: int
    received: float                   # perf_counter() when the request arrived, for time to first token
    header: dict = field(default_factory=dict)   # id, object, created, model: the start of every response
    include_usage: bool = False       # stream_options.include_usage: a last chunk with usage
    release: object = None            # gives its engine requests back to Admission (idempotent)

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however it ends.

    Starlette cancels the streaming task when the client disconnects, but a
    generator paused at ``yield`` would only be closed by the garbage
    collector; closing it here aborts the engine requests right away.
    """
    media_type = "text/event-stream"

    def __init__(self, content, on_close=None, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


class Server:
    def __init__(self, engine: Engine, model_name: str | None = None, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, limits: Limits | None = None):
        self.engine = engine
        self.model_name = model_name or engine.model_name
        if api_key == "":
            raise ConfigError("the API key is empty: give a key, or leave it out to serve without one")
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.admission = Admission(engine.config.max_batch_size + self.limits.waiting(engine.config.max_batch_size))
        # A private tokenizer: the engine thread decodes with its own at the same time. Tokenizing and
        # chat templates run in this one worker thread (in order), never in the event loop.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="lmport-tokenize")
        self.loop = EngineLoop(engine)
        # /metrics reads what the engine thread publishes after each step: a scrape never waits for a step.
        self.metrics = Metrics(lambda: self.loop.snapshot)
        Gauge("lmport_requests_admitted", "Engine requests admitted by the server and not yet finished",
              registry=self.metrics.registry).set_function(lambda: self.admission.active)
        self.created = int(time.time())
        self.live: set[asyncio.Queue] = set()   # the output queues of jobs in flight (see abort_all)

    def engine_problem(self) -> str | None:
        """Why no request can be served now, or None."""
        if self.loop.failure is not None:
            return self.loop.failure
        if not self.loop._thread.is_alive():
            return "the engine thread has stopped"
        if self.engine.failure:  # a tensor-parallel rank is gone: nothing can be generated
            return f"engine failed: {self.engine.failure}"
        return None

    async def tokenize(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def admit(self, job: "_Job") -> None:
        problem = self.engine_problem()
        if problem is not None:
            raise APIError(503, f"the server cannot generate: {problem}", type="server_error", code="engine_stopped")
        job.release = self.admission.admit(len(job.configs))

    def abort_all(self, error: APIError) -> None:
        """End every job in flight with ``error`` (streams: a final error event and [DONE])."""
        for queue in list(self.live):
            queue.put_nowait((None, error))

    async def drain(self, timeout: float) -> None:
        """Shutdown: admit nothing more, give jobs in flight ``timeout`` seconds, then abort the rest."""
        self.admission.closed = "the server is shutting down; retry on another instance or after the restart"
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live:
            log.warning("aborting %d request(s) still running after the %.0f s shutdown timeout",
                        len(self.live), timeout)
            self.abort_all(APIError(503, "the server is shutting down: the request was aborted",
                                    type="server_error", code="shutting_down"))

    # -- request parsing ------------------------------------------------------------------------
    async def parse(self, request: Request, cls):
        """Read the body (up to max_body_bytes) and validate it into ``cls``."""
        too_large = APIError(413, f"the request body is larger than the server's limit of {self.max_body_bytes} "
                                  f"bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > self.max_body_bytes:
                        raise too_large
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s",
                           code="body_timeout") from None
        try:
            req = cls.model_validate_json(bytes(body))
        except ValidationError as exc:
            raise validation_error(exc) from None
        if req.model != self.model_name:
            raise APIError(404, f"model: {brief(req.model)} does not exist; this server serves "
                                f"{self.model_name!r} (see GET /v1/models)", param="model", code="model_not_found")
        for problem in (req.unsupported_problem(), req.stop_problem()):
            if problem is not None:
                raise problem
        vocab = self.engine.model_config.vocab_size
        if req.top_k > vocab:
            raise APIError(400, f"top_k: {brief(req.top_k)} is more than the vocabulary ({vocab} tokens); give "
                                f"at most {vocab}, or 0 for no top-k", param="top_k")
        return req

    def job(self, req, prompts: list[list[int]], param: str, max_tokens: int | None,
            logprobs: int | None, received: float, response_format: dict | None = None) -> _Job:
        """Check every prompt against the engine and build one GenerationConfig per choice."""
        configs = []
        for ids in prompts:
            try:
                # validate() reads only fixed facts (vocab, session_len): safe without the engine lock.
                self.engine.validate(ids)
            except RequestError as exc:
                raise APIError(400, f"{param}: {exc}", param=param) from None
            for i in range(req.n):
                try:
                    configs.append(GenerationConfig(
                        # No max_tokens: up to the session length, as OpenAI does up to the context.
                        max_new_tokens=max_tokens or self.engine.session_len - len(ids),
                        temperature=req.temperature, do_sample=req.temperature > 0,
                        top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
                        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty,
                        # n choices from one seed differ from each other yet repeat run to run.
                        random_seed=None if req.seed is None else (req.seed + i) % 2**64,
                        stop_words=req.stop_words, ignore_eos=req.ignore_eos, logprobs=logprobs,
                        response_format=response_format))
                except ConfigError as exc:
                    raise APIError(400, str(exc)) from None
        return _Job(f"{uuid.uuid4().hex}", int(time.time()), prompts, configs, req.n, received)

    # -- generation -----------------------------------------------------------------------------
    async def outputs(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every choice at once; yield (choice index, output) as outputs arrive.

        Closing this iterator (or cancelling its consumer) aborts every unfinished choice.
        """
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: int, config: GenerationConfig):
            try:
                async for out in self.loop.generate(job.prompt_of(choice), config, f"{job.id}-{choice}"):
                    queue.put_nowait((choice, out))
            except Exception as exc:  # reaches the consumer instead of dying in this task
                queue.put_nowait((choice, exc))

        tasks = [asyncio.create_task(pump(c, cfg)) for c, cfg in enumerate(job.configs)]
        last = [None] * len(tasks)  # when each choice last produced a token
        remaining = len(tasks)
        self.live.add(queue)
        timeout = self.limits.request_timeout
        timer = None if timeout is None else asyncio.get_running_loop().call_later(
            max(0.0, job.received + timeout - time.perf_counter()), queue.put_nowait,
            (None, APIError(504, f"the request did not finish within the server's {timeout:g} s timeout "
                                 f"(--request-timeout) and was aborted", type="server_error", code="timeout")))
        try:
            while remaining:
                choice, out = await queue.get()
                if isinstance(out, EngineStopped) or (isinstance(out, RequestError) and self.engine_problem()):
                    # RequestError too: the engine failed between admit() and add_request()
                    raise APIError(503, f"the server cannot generate: {out}", type="server_error",
                                   code="engine_stopped")
                if isinstance(out, Exception):
                    raise out
                now = time.perf_counter()
                if out.delta_token_ids:
                    if last[choice] is None:
                        self.metrics.ttft.observe(now - job.received)
                    else:
                        self.metrics.itl.observe(now - last[choice])
                    last[choice] = now
                if out.finished:
                    remaining -= 1
                    self.metrics.finished.labels(out.finish_reason).inc()
                    self.metrics.e2e.observe(now - job.received)
                yield choice, out
        finally:
            self.live.discard(queue)
            if timer is not None:
                timer.cancel()
            if remaining:  # the consumer left early (a client that went away): those choices are aborted
                self.metrics.finished.labels("abort").inc(remaining)
            for task in tasks:
                task.cancel()  # a cancelled pump closes its generate(), which aborts the request
            # Last: inside a cancelled anyio scope (Starlette's disconnect handling) this await raises again.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, job: _Job) -> list[RequestOutput]:
        """Every choice's final output, in choice order."""
        final: list[RequestOutput | None] = [None] * len(job.configs)
        async for choice, out in self.outputs(job):
            if out.finished:
                final[choice] = out
        return final

    async def until_done_or_gone(self, request: Request, job: _Job) -> list[RequestOutput] | None:
        """collect(), or None when the client disconnects first (its requests are then aborted)."""
        work = asyncio.ensure_future(self.collect(job))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # the client left (or this handler was cancelled): abort the choices
                await asyncio.gather(work, return_exceptions=True)
        return None if work.cancelled() else work.result()

    # -- response pieces ------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, out: RequestOutput, start: int, top: int) -> dict:
        content = []
        for token_id, entry in zip(out.token_ids[start:], out.logprobs[start:]):
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            content.append({**self._lp(token_id, entry[token_id]),
                            "top_logprobs": [self._lp(t, lp) for t, lp in best]})
        return {"content": content}

    def completion_logprobs(self, out: RequestOutput, start: int, top: int) -> dict:
        """OpenAI's legacy logprobs for tokens ``start:``; text_offset counts the tokens' own texts."""
        offset = sum(len(self.token_text(t)) for t in out.token_ids[:start])
        tokens = [self.token_text(t) for t in out.token_ids[start:]]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens,
                "token_logprobs": [entry[t] for t, entry in zip(out.token_ids[start:], out.logprobs[start:])],
                "top_logprobs": [{self.token_text(t): lp for t, lp in sorted(e.items(), key=lambda kv: -kv[1])[:top]}
                                 for e in out.logprobs[start:]],
                "text_offset": offsets}

    def _lp(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def usage(self, job: _Job, outs: list[RequestOutput]) -> dict:
        prompt = sum(len(p) for p in job.prompts)
        completion = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    if out.finish_reason == "error":
        raise APIError(500, f"generation failed: {out.error}", type="server_error")
    return out.finish_reason


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(server: Server, job: _Job, chunk) -> AsyncIterator[str]:
    """SSE lines: ``chunk(choice, out, delta, first, logprobs_from)`` per output, usage when asked, [DONE].

    ``out.text`` never shows what may still turn out to be a stop string: the engine holds it back.
    """
    finals: list[RequestOutput] = []
    sent_text = [0] * len(job.configs)
    sent_logprobs = [0] * len(job.configs)
    started = [False] * len(job.configs)
    stream = server.outputs(job)
    try:
        try:
            async for choice, out in stream:
                if out.finished:
                    finals.append(out)
                if out.finished and out.finish_reason == "error":
                    yield _sse(APIError(500, f"choice {choice}: generation failed: {out.error}",
                                        type="server_error").body())
                    continue
                delta = out.text[sent_text[choice]:]
                new_logprobs = len(out.logprobs) > sent_logprobs[choice]
                if delta or out.finished or new_logprobs:
                    yield _sse(chunk(choice, out, delta, not started[choice], sent_logprobs[choice]))
                    started[choice], sent_logprobs[choice] = True, len(out.logprobs)
                    sent_text[choice] += len(delta)
        except APIError as exc:  # timeout, shutdown, engine stopped: the stream still ends properly
            yield _sse(exc.body())
            yield _sse("[DONE]")
            return
        if job.include_usage:
            yield _sse({**job.header, "choices": [], "usage": server.usage(job, finals)})
        yield _sse("[DONE]")
    finally:
        await stream.aclose()


def create_app(engine: Engine, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, limits: Limits | None = None,
               allowed_hosts: set[str] | None = None, cors_origins: list[str] | None = None,
               docs: bool = True) -> FastAPI:
    """The app; wrapped in the cross-site Guards when ``allowed_hosts`` (Host names) is given, and in CORS
    for ``cors_origins``. The returned object is the FastAPI app either way (``app.state.server``)."""
    server = Server(engine, model_name, api_key, max_body_bytes, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.loop.shutdown()
        server.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="lmport", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    def require_key(request: Request) -> None:
        if server.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), server.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key")

    auth = [Depends(require_key)]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        server.metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return await api_error(request, APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                                                  f"{exc.detail}", code=str(exc.status_code)))

    if docs:  # behind the API key like every other route but /health
        @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
        async def openapi():
            return app.openapi()

        @app.get("/docs", dependencies=auth, include_in_schema=False)
        async def swagger():
            return get_swagger_ui_html(openapi_url="/openapi.json", title="lmport")

        @app.get("/redoc", dependencies=auth, include_in_schema=False)
        async def redoc():
            return get_redoc_html(openapi_url="/openapi.json", title="lmport")

    @app.get("/health")
    async def health():
        problem = server.engine_problem()
        if problem is not None:
            return JSONResponse({"status": "engine stopped", "reason": problem}, status_code=503)
        if server.admission.closed:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", dependencies=auth)
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "lmport", "max_model_len": engine.session_len}]}

    max_chars = server.limits.prompt_chars(engine.session_len)

    def too_long(param: str, chars: int) -> APIError:
        return APIError(400, f"{param}: {chars} characters is more than the server's limit of {max_chars} "
                             f"(--max-prompt-chars; the session holds {engine.session_len} tokens): shorten it",
                        param=param)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        received = time.perf_counter()
        req: ChatCompletionRequest = await server.parse(request, ChatCompletionRequest)
        if not req.messages:
            raise APIError(400, "messages: the list is empty; give at least one message", param="messages")
        if (chars := sum(len(m.text()) for m in req.messages)) > max_chars:
            raise too_long("messages", chars)
        setup = tools.check(req, engine)
        try:
            ids = await server.tokenize(tools.encode, server.tokenizer, req, setup)
        except APIError:
            raise
        except Exception as exc:  # a chat template may refuse a conversation (e.g. roles out of order)
            raise APIError(400, f"messages: the chat template refused them: {brief(str(exc), 300)}",
                           param="messages") from None
        response_format = req.response_format
        structured.check_format(engine, response_format, "response_format")
        if setup is not None and setup.response_format is not None:
            if structured.constrains(response_format):
                raise APIError(400, "response_format: cannot be combined with a tool_choice that forces a call",
                               param="response_format")
            response_format = setup.response_format
            structured.check_format(engine, response_format, "tools")
        top = (req.top_logprobs or 0) if req.logprobs else None
        job = server.job(req, [ids], "messages", req.max_completion_tokens or req.max_tokens, top, received,
                         response_format)
        job.header = {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created,
                      "model": server.model_name}
        job.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        server.admit(job)

        if req.stream:
            parsers = [tools.StreamParser(setup) for _ in job.configs] if setup else None
            called = [False] * len(job.configs)

            def chunk(choice, out, text, first, lp_from):
                calls = []
                if parsers:
                    text, calls = parsers[choice].feed(text, out.finished)
                    called[choice] |= bool(calls)
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                if calls:
                    delta["tool_calls"] = calls
                finish = _finish_reason(out)
                return {**job.header, "choices": [{
                    "index": choice, "delta": delta,
                    "finish_reason": "tool_calls" if finish == "stop" and called[choice] else finish,
                    "logprobs": server.chat_logprobs(out, lp_from, top) if top is not None else None}]}
            return EventStream(_events(server, job, chunk), on_close=job.release, headers={"Cache-Control": "no-cache"})

        try:
            outs = await server.until_done_or_gone(request, job)
        finally:
            job.release()
        if outs is None:
            return Response(status_code=499)  # nobody is listening
        choices = []
        for c, o in enumerate(outs):
            message, finish = {"role": "assistant", "content": o.text}, _finish_reason(o)
            if setup is not None:
                message["content"], calls = tools.parse(o.text, setup)
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c, "message": message, "finish_reason": finish,
                            "logprobs": server.chat_logprobs(o, 0, top) if top is not None else None})
        return {**job.header, "object": "chat.completion", "usage": server.usage(job, outs), "choices": choices}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
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
            if isinstance(p, str) and len(p) > max_chars:
                raise too_long("prompt", len(p))
        prompts = await server.tokenize(
            lambda: [server.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt])
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: 0 generates nothing; it is allowed only with echo (to score the "
                                "prompt)", param="max_tokens")
        if req.echo and req.stream:
            raise APIError(400, "echo: not supported with stream; send echo without stream", param="echo")
        response_format, format_param = structured.completion_format(req)
        structured.check_format(engine, response_format, format_param)
        job = server.job(req, prompts, "prompt", req.max_tokens, req.logprobs, received, response_format)
        job.header = {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created,
                      "model": server.model_name}
        job.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        top = req.logprobs
        server.admit(job)
        if req.echo:
            texts = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in prompt]
            try:
                return await echo_completion(req, job, top, request, texts)
            finally:
                job.release()

        if req.stream:
            def chunk(choice, out, text, first, lp_from):
                return {**job.header, "choices": [{
                    "index": choice, "text": text, "finish_reason": _finish_reason(out),
                    "logprobs": server.completion_logprobs(out, lp_from, top) if top is not None else None}]}
            return EventStream(_events(server, job, chunk), on_close=job.release, headers={"Cache-Control": "no-cache"})

        try:
            outs = await server.until_done_or_gone(request, job)
        finally:
            job.release()
        if outs is None:
            return Response(status_code=499)
        return {**job.header, "usage": server.usage(job, outs), "choices": [
            {"index": c, "text": o.text, "finish_reason": _finish_reason(o),
             "logprobs": server.completion_logprobs(o, 0, top) if top is not None else None}
            for c, o in enumerate(outs)]}

    async def echo_completion(req: CompletionRequest, job: _Job, top: int | None, request: Request,
                              prompt_texts: list[str]):
        """The prompt (text and logprobs) before each choice's completion; only the prompt with max_tokens 0."""
        scores = [await echo.prompt_logprobs(server, ids, top or 0) if top is not None else None
                  for ids in job.prompts]
        if req.max_tokens == 0:
            outs = [None] * len(job.configs)
        else:
            outs = await server.until_done_or_gone(request, job)
            if outs is None:
                return Response(status_code=499)
        choices = []
        for c, o in enumerate(outs):
            ids = job.prompt_of(c)
            generated = None if o is None or top is None else server.completion_logprobs(o, 0, top)
            choices.append({"index": c, "text": prompt_texts[c // job.n] + (o.text if o else ""),
                            "finish_reason": _finish_reason(o) if o else "length",
                            "logprobs": echo.merge(server, ids, scores[c // job.n], top, generated)})
        completion = sum(len(o.token_ids) for o in outs if o)
        prompt_tokens = sum(len(p) for p in job.prompts)
        return {**job.header, "choices": choices, "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}}

    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Guards, allowed_hosts=allowed_hosts)
    return app


def serve(args) -> int:
    """`lmport serve MODEL` with the server flags (see docs/server.md) and every EngineConfig flag."""
    import uvicorn

    from lmport.flags import engine_config
    from lmport.server.connections import ConnectionLimits
    from lmport.server.guards import allowed_host_names, is_loopback
    from lmport.server.shutdown import GracefulServer

    api_key = args.api_key if args.api_key is not None else os.environ.get("LMPORT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ConfigError("the API key is empty (--api-key or LMPORT_API_KEY): give a key, or leave both out "
                          "to serve without one")
    limits = Limits(max_engine_requests=args.max_engine_requests_per_request, max_prompt_chars=args.max_prompt_chars,
                    max_waiting_requests=args.max_waiting_requests, request_timeout=args.request_timeout,
                    body_timeout=args.body_timeout)
    connections = ConnectionLimits(header_timeout=args.header_timeout, keep_alive_timeout=args.keep_alive_timeout,
                                   max_connections=args.max_connections)
    engine = Engine(args.model, engine_config(args))
    app = create_app(engine, model_name=args.model, api_key=api_key, limits=limits,
                     allowed_hosts=allowed_host_names(args.host, args.allowed_hosts),
                     cors_origins=args.cors_origins, docs=args.docs)
    if not is_loopback(args.host) and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)
    print(f"lmport serve: {args.model} on http://{args.host}:{args.port} (session_len {engine.session_len}, "
          f"{engine.plan.num_blocks} KV blocks){'; API key required' if api_key else ''}", file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=logging.getLevelName(
        logging.getLogger().level).lower(), **connections.uvicorn_kwargs())
    server = GracefulServer(config, app.state.server, shutdown_timeout=args.shutdown_timeout,
                            exit_on_engine_failure=args.exit_on_engine_failure)
    server.run()
    return server.exit_code
