"""The HTTP front end's side of the engine core: request parsing, admission, jobs, outputs as they arrive,
response pieces.

``Frontend`` is shared by the routes (``lmport.server.routes``) and the app (``lmport.server.app``): the
engine core runs behind an ``EngineClient`` (its own process under `lmport serve`), each HTTP request
becomes a ``Job`` with one engine request per choice, and a client that goes away aborts its engine requests.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import cast

from fastapi import Request
from fastapi.responses import StreamingResponse
from prometheus_client import Gauge
from pydantic import ValidationError

from lmport.config import ConfigError, GenerationConfig
from lmport.engine import RequestError, RequestOutput, check_prompt, is_request_fault
from lmport.engine_client import EngineHandle, EngineStopped
from lmport.engine_messages import EngineRequest
from lmport.guided import Grammars
from lmport.lora import AdapterError
from lmport.server import adapters
from lmport.server.limits import Admission, Limits
from lmport.server.metrics import Metrics
from lmport.server.protocol import APIError, brief, validation_error

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 2 * 2**20


@dataclass
class Job:
    """One HTTP generation request: its prompts and one GenerationConfig per choice."""
    id: str
    created: int
    prompts: list[list[int]]
    configs: list[GenerationConfig]   # len(prompts) * n, choice index = prompt index * n + sample index
    n: int
    received: float                   # perf_counter() when the request arrived, for time to first token
    header: dict = field(default_factory=dict)   # id, object, created, model: the start of every response
    include_usage: bool = False       # stream_options.include_usage: a last chunk with usage
    continuous_usage: bool = False    # stream_options.continuous_usage_stats (vLLM's): usage on every chunk
    release: object = None            # gives its engine requests back to Admission (idempotent)
    cache_salt: str | None = None     # prefix-cache isolation: the request's cache_salt and/or its API key's
    adapter: str | None = None        # the LoRA adapter its model names (lmport.server.adapters), None: the base

    def stream_usage(self, options) -> None:
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options.continuous_usage_stats)

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however it ends.

    Starlette cancels the streaming task when the client disconnects, but a
    generator paused at ``yield`` would only be closed by the garbage
    collector; closing it here aborts the engine requests right away.

    A client that stops reading fills the socket's buffers, and then a send waits. No send may wait longer
    than ``send_timeout`` seconds, nor past ``deadline`` (time.perf_counter(); the request timeout) plus
    ``DEADLINE_GRACE`` for the final error event: the connection is then closed, which aborts the engine
    requests and gives their admission slots back.
    """
    media_type = "text/event-stream"
    DEADLINE_GRACE = 1.0

    def __init__(self, content, on_close=None, send_timeout: float | None = None, deadline: float | None = None,
                 **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close
        self.send_timeout, self.deadline = send_timeout, deadline
        self.cut = False   # a send waited too long and the connection was closed

    def _send_limit(self) -> float | None:
        limits = [t for t in (self.send_timeout, None if self.deadline is None else max(
            0.0, self.deadline - time.perf_counter()) + self.DEADLINE_GRACE) if t is not None]
        return min(limits) if limits else None

    async def __call__(self, scope, receive, send):
        async def timed_send(message):
            try:
                async with asyncio.timeout(self._send_limit()):
                    await send(message)
            except TimeoutError:
                self.cut = True
                raise _SendTimeout from None

        try:
            await super().__call__(scope, receive, timed_send)
        except BaseException as exc:
            if not self.cut:
                raise
            log.warning("closed a stream whose client stopped reading (%s)", type(exc).__name__)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


class _SendTimeout(Exception):
    """A send to a client that does not read waited past its limit."""


class Frontend:
    def __init__(self, core: EngineHandle, tokenizer, grammars: Grammars, model_name: str | None = None,
                 api_key: str | list[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 limits: Limits | None = None, cache_salt_by_api_key: bool = False):
        """``core``: what runs the requests, an engine core's client or, with data-parallel replicas, their front
        end (``lmport.dp.frontend.DataParallel``); ``tokenizer``: the front end's own (tokenizing and chat
        templates run here, never in the core); ``grammars``: compiles structured-output formats to check them
        before a request is queued."""
        self.core = core
        self.info = info = core.info
        self.grammars = grammars
        self.model_name = model_name or info.model_name
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        if any(not k.strip() for k in keys):
            raise ConfigError("the API key is empty: give a key, or leave it out to serve without one")
        self.api_keys = tuple(keys)   # any of them is accepted
        self.api_key = keys[0] if keys else None
        # Prefix-cache blocks are shared only between requests sent with the same key (and cache_salt).
        self.cache_salt_by_api_key = cache_salt_by_api_key
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.max_prompt_chars = self.limits.prompt_chars(info.session_len)
        self.admission = Admission(info.max_batch_size + self.limits.waiting(info.max_batch_size))
        # Tokenizing and chat templates run in this one worker thread (in order), never in the event loop.
        self.tokenizer = tokenizer
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="lmport-tokenize")
        # Grammar compiles (structured outputs, forced tool calls), off the event loop (lmport.server.structured).
        self.compile_pool = ThreadPoolExecutor(2, thread_name_prefix="lmport-compile")
        # /metrics reads what the engine core publishes after each step: a scrape never waits for a step.
        self.metrics = Metrics(lambda: self.core.snapshot)
        Gauge("lmport_requests_admitted", "Engine requests admitted by the server and not yet finished",
              registry=self.metrics.registry).set_function(lambda: self.admission.active)
        self.created = int(time.time())
        # Identifies the configuration answering (OpenAI's system_fingerprint): lmport's version and the engine's
        # settings that change outputs.
        self.fingerprint = "fp_lmport_" + hashlib.sha256(repr((
            lmport_version(), self.model_name, info.device_type, info.dtype,
            info.quant_policy)).encode()).hexdigest()[:12]
        self.live: set[asyncio.Queue] = set()   # the output queues of jobs in flight (see abort_all)

    def engine_problem(self) -> str | None:
        """Why no request can be served now, or None."""
        return self.core.problem()

    def check_prompt(self, prompt_ids) -> None:
        """RequestError when the engine cannot take these prompt token ids."""
        check_prompt(prompt_ids, self.info.vocab_size, self.info.session_len)

    async def tokenize(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def admit(self, job: Job) -> None:
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
        adapters.adapter_for(self, req.model)   # the base model or a loaded LoRA adapter, else a 404
        for problem in (req.unsupported_problem(), req.stop_problem()):
            if problem is not None:
                raise problem
        vocab = self.info.vocab_size
        req.token_bias(vocab)
        if req.top_k > vocab:
            raise APIError(400, f"top_k: {brief(req.top_k)} is more than the vocabulary ({vocab} tokens); give "
                                f"at most {vocab}, or 0 for no top-k", param="top_k")
        return req

    def job(self, req, prompts: list[list[int]], param: str, max_tokens: int | None,
            logprobs: int | None, received: float, response_format: dict | None = None,
            key: str | None = None, prompt_logprobs: int | None = None) -> Job:
        """Check every prompt against the engine's facts and build one GenerationConfig per choice.
        ``prompt_logprobs``: each choice also scores its prompt with that many alternatives (echo)."""
        configs = []
        info = self.info
        logit_bias = req.token_bias(info.vocab_size)
        for ids in prompts:
            try:
                self.check_prompt(ids)
            except RequestError as exc:
                # OpenAI's clients look for this code to tell "shorten the prompt" from other errors.
                code = "context_length_exceeded" if len(ids) >= info.session_len else None
                raise APIError(400, f"{param}: {exc}", param=param, code=code) from None
            for i in range(req.n):
                try:
                    configs.append(GenerationConfig(
                        # No max_tokens: up to the session length, as OpenAI does up to the context.
                        max_new_tokens=info.session_len - len(ids) if max_tokens is None else max_tokens,
                        temperature=req.temperature, do_sample=req.temperature > 0,
                        top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
                        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty,
                        # n choices from one seed differ from each other yet repeat run to run.
                        random_seed=None if req.seed is None else (req.seed + i) % 2**64,
                        stop_words=req.stop_words, ignore_eos=req.ignore_eos, logprobs=logprobs,
                        response_format=response_format, logit_bias=logit_bias,
                        prompt_logprobs=prompt_logprobs, speculate=req.speculate))
                except ConfigError as exc:
                    raise APIError(400, str(exc)) from None
        job = Job(f"{uuid.uuid4().hex}", int(time.time()), prompts, configs, req.n, received)
        job.cache_salt = self.cache_salt(req.cache_salt, key)
        job.adapter = adapters.adapter_for(self, req.model)
        return job

    def cache_salt(self, salt: str | None, key: str | None) -> str | None:
        """The prefix-cache salt: the request's ``cache_salt``, under a digest of its API key when the server
        salts by key (so one key's requests can never hit, or time, another key's cached prefixes)."""
        if not self.cache_salt_by_api_key or key is None:
            return salt
        digest = hashlib.sha256(b"lmport-cache-salt:" + key.encode()).hexdigest()[:32]
        return digest if salt is None else f"{digest}:{salt}"

    # -- generation -----------------------------------------------------------------------------
    async def outputs(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every choice at once; yield (choice index, output so far) as outputs arrive.

        The core sends deltas; each choice's output so far is one RequestOutput that grows in place (read it
        before the next ``await``). A consumer that falls behind (a client that does not read) holds at most one
        pending entry a choice, never a copy of the output per step. A timeout or shutdown error overtakes the
        pending outputs. Closing this iterator (or cancelling its consumer) aborts every unfinished choice.
        """
        queue: asyncio.Queue = asyncio.Queue()   # choice indices with news (once each), or (None, error)
        state: list[RequestOutput | None] = [None] * len(job.configs)
        pending = [False] * len(job.configs)
        last: list[float | None] = [None] * len(job.configs)  # when each choice last produced a token

        def merge(choice: int, out: RequestOutput) -> None:
            acc = state[choice]
            if acc is None:
                acc = state[choice] = RequestOutput(out.request_id, [], "", [], "", False, None, out.prompt_tokens,
                                                    out.cached_tokens)
            acc.token_ids.extend(out.delta_token_ids)
            acc.logprobs.extend(out.delta_logprobs)
            # A finished output carries its whole text (decoded once at the end); what was streamed is its start.
            acc.text = out.text if out.finished else acc.text + out.delta_text
            acc.finished, acc.finish_reason, acc.error = out.finished, out.finish_reason, out.error
            acc.cached_tokens, acc.prompt_logprobs = out.cached_tokens, out.prompt_logprobs
            now = time.perf_counter()
            if out.delta_token_ids:
                previous = last[choice]
                if previous is None:
                    self.metrics.ttft.observe(now - job.received)
                else:
                    self.metrics.itl.observe(now - previous)
                last[choice] = now
            if out.finished:
                self.metrics.finished.labels(out.finish_reason).inc()
                self.metrics.e2e.observe(now - job.received)
            if not pending[choice]:
                pending[choice] = True
                queue.put_nowait(choice)

        async def pump(choice: int, config: GenerationConfig):
            try:
                request = EngineRequest(f"{job.id}-{choice}", job.prompt_of(choice), config, job.cache_salt,
                                        job.adapter)
                async for out in self.core.generate(request):
                    merge(choice, out)
            except Exception as exc:  # reaches the consumer instead of dying in this task
                queue.put_nowait((None, exc))

        tasks = [asyncio.create_task(pump(c, cfg)) for c, cfg in enumerate(job.configs)]
        remaining = len(tasks)
        self.live.add(queue)
        timeout = self.limits.request_timeout
        timer = None if timeout is None else asyncio.get_running_loop().call_later(
            max(0.0, job.received + timeout - time.perf_counter()), queue.put_nowait,
            (None, APIError(504, f"the request did not finish within the server's {timeout:g} s timeout "
                                 f"(--request-timeout) and was aborted", type="server_error", code="timeout")))
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, tuple):
                    out = item[1]
                    if isinstance(out, EngineStopped) or (isinstance(out, RequestError) and self.engine_problem()):
                        # RequestError too: the engine failed between admit() and add_request()
                        raise APIError(503, f"the server cannot generate: {out}", type="server_error",
                                       code="engine_stopped")
                    if isinstance(out, AdapterError):   # unloaded between the request's check and its start
                        raise adapters.adapter_error(out)
                    raise out
                pending[item] = False
                out = cast(RequestOutput, state[item])   # set before the item was marked pending
                if out.finished:
                    remaining -= 1
                yield item, out
        finally:
            self.live.discard(queue)
            if timer is not None:
                timer.cancel()
            if remaining:  # the consumer left early (a client that went away): those choices are aborted
                self.metrics.finished.labels("abort").inc(sum(1 for o in state if o is None or not o.finished))
            for task in tasks:
                task.cancel()  # a cancelled pump closes its generate(), which aborts the request
            # Last: inside a cancelled anyio scope (Starlette's disconnect handling) this await raises again.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, job: Job) -> list[RequestOutput]:
        """Every choice's final output, in choice order."""
        final: list[RequestOutput | None] = [None] * len(job.configs)
        async for choice, out in self.outputs(job):
            if out.finished:
                final[choice] = out
        return cast(list[RequestOutput], final)   # outputs() ends only when every choice has finished

    async def until_done_or_gone(self, request: Request, job: Job) -> list[RequestOutput] | None:
        """collect(), or None when the client disconnects first (its requests are then aborted)."""
        return await self.unless_gone(request, self.collect(job))

    async def unless_gone(self, request: Request, work):
        """Await the coroutine ``work``, or cancel it and return None when the client disconnects first."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()  # the client left (or this handler was cancelled): stop the work
                await asyncio.gather(task, return_exceptions=True)
        return None if task.cancelled() else task.result()

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

    def usage(self, job: Job, outs: list[RequestOutput]) -> dict:
        prompt = sum(len(p) for p in job.prompts)
        completion = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)}}


def finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    if out.finish_reason == "error":
        raise generation_error(out)
    return out.finish_reason


def generation_error(out: RequestOutput, choice: int | None = None) -> APIError:
    """The error that ended a choice: a 400 when its own format caused it (lmport.engine.is_request_fault),
    else a 500."""
    where = "" if choice is None else f"choice {choice}: "
    if is_request_fault(out.error):
        return APIError(400, f"{where}{out.error}", param="response_format", code="format_failed")
    return APIError(500, f"{where}generation failed: {out.error}", type="server_error")


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def lmport_version() -> str:
    try:
        return version("lmport")
    except PackageNotFoundError:
        return "unknown"


async def event_lines(server: Frontend, job: Job, chunk) -> AsyncIterator[str]:
    """SSE lines: the chunks ``chunk(choice, out, delta, logprobs_from)`` makes of each output (none when it
    holds the text back), usage when asked, [DONE].

    ``out.text`` never shows what may still turn out to be a stop string: the engine holds it back.
    """
    finals: list[RequestOutput] = []
    sent_text = [0] * len(job.configs)
    sent_logprobs = [0] * len(job.configs)
    stream = server.outputs(job)
    try:
        try:
            async for choice, out in stream:
                if out.finished:
                    finals.append(out)
                if out.finished and out.finish_reason == "error":
                    yield _sse(generation_error(out, choice).body())
                    continue
                delta = out.text[sent_text[choice]:]
                sent_text[choice] += len(delta)
                pieces = chunk(choice, out, delta, sent_logprobs[choice])
                if pieces:
                    sent_logprobs[choice] = len(out.logprobs)
                for piece in pieces:
                    if job.continuous_usage:
                        prompt = len(job.prompt_of(choice))
                        piece["usage"] = {"prompt_tokens": prompt, "completion_tokens": len(out.token_ids),
                                          "total_tokens": prompt + len(out.token_ids)}
                    yield _sse(piece)
        except APIError as exc:  # timeout, shutdown, engine stopped: the stream still ends properly
            yield _sse(exc.body())
            yield _sse("[DONE]")
            return
        if job.include_usage:
            yield _sse({**job.header, "choices": [], "usage": server.usage(job, finals)})
        yield _sse("[DONE]")
    finally:
        await stream.aclose()
