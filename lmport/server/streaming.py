"""An admitted job's way back to its client, the same for every API: its choices' outputs fanned into one stream,
server-sent events or one reply, and a client that leaves or stops reading aborts the job's engine requests.

Here so that the routes and the other APIs (``lmport.server.anthropic``, ``.responses``) differ only in the shapes
they give the outputs (``lmport.server.openai_mapping``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lmport.config import GenerationConfig
from lmport.engine.outputs import PackedLogprobs, RequestError, RequestOutput
from lmport.engine.client import EngineStopped
from lmport.engine.messages import EngineRequest
from lmport.lora import AdapterError
from lmport.server import adapters, answers
from lmport.server.frontend import Frontend, Job
from lmport.server.openai_mapping import Chunks, UsageChunk, generation_error
from lmport.server.protocol import APIError, brief
from lmport.server.shapes import Usage

log = logging.getLogger(__name__)


async def respond(frontend: Frontend, request: Request, job: Job, events: Callable[[], AsyncIterator[str]],
                  body: Callable[[list[RequestOutput]], Mapping[str, object]], *, stream: bool):
    """An admitted job's reply: ``events()`` (server-sent event lines) as a stream, or ``body(final outputs)``
    once all are done, within the size limit and built off the event loop (lmport.server.answers); 499 when
    the client left first."""
    if stream:
        timeout = frontend.limits.request_timeout
        return EventStream(events(), on_close=job.release, headers={"Cache-Control": "no-cache"},
                           send_timeout=frontend.limits.send_timeout,
                           deadline=None if timeout is None else job.received + timeout)
    try:
        answers.check_size(frontend, job)   # before anything is generated
        outs = await until_done_or_gone(frontend, request, job)
    finally:
        job.release()
    if outs is None:
        return Response(status_code=499)  # nobody is listening
    return await answers.json_response(lambda: body(outs))


# -- fan-in ---------------------------------------------------------------------------------------------------

async def outputs(frontend: Frontend, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run every choice at once; yield (choice index, output so far) as outputs arrive.

    The core sends deltas; each choice's output so far is one RequestOutput that grows in place (read it
    before the next ``await``). A consumer that falls behind (a client that does not read) holds at most one
    pending entry a choice, never a copy of the output per step. A timeout or shutdown error overtakes the
    pending outputs. Closing this iterator (or cancelling its consumer) aborts every unfinished choice.
    """
    metrics = frontend.metrics
    queue: asyncio.Queue = asyncio.Queue()   # choice indices with news (once each), or (None, error)
    state: list[RequestOutput | None] = [None] * len(job.configs)
    pending = [False] * len(job.configs)
    last: list[float | None] = [None] * len(job.configs)  # when each choice last produced a token

    def merge(choice: int, out: RequestOutput) -> None:
        acc = state[choice]
        if acc is None:
            acc = state[choice] = RequestOutput(out.request_id, [], "", [], "", False, None, out.prompt_tokens,
                                                out.cached_tokens, logprobs=PackedLogprobs())
        acc.token_ids.extend(out.delta_token_ids)
        acc.logprobs.extend(out.delta_logprobs)
        # A finished output carries its whole text (decoded once at the end); what was streamed is its start.
        acc.text = out.text if out.finished else acc.text + out.delta_text
        acc.finished, acc.finish_reason, acc.error = out.finished, out.finish_reason, out.error
        acc.error_kind = out.error_kind
        acc.cached_tokens, acc.prompt_logprobs = out.cached_tokens, out.prompt_logprobs
        now = time.perf_counter()
        if out.delta_token_ids:
            previous = last[choice]
            if previous is None:
                metrics.ttft.observe(now - job.received)
            else:
                metrics.itl.observe(now - previous)
            last[choice] = now
        if out.finished:
            metrics.finished.labels(out.finish_reason).inc()
            metrics.e2e.observe(now - job.received)
        if not pending[choice]:
            pending[choice] = True
            queue.put_nowait(choice)

    async def pump(choice: int, config: GenerationConfig):
        try:
            request = EngineRequest(f"{job.id}-{choice}", job.prompt_of(choice), config, job.cache_salt,
                                    job.adapter, images=job.images, group=job.id if len(job.configs) > 1 else None)
            async for out in frontend.core.generate(request):
                merge(choice, out)
        except Exception as exc:  # reaches the consumer instead of dying in this task
            queue.put_nowait((None, exc))

    tasks = [asyncio.create_task(pump(c, cfg)) for c, cfg in enumerate(job.configs)]
    remaining = len(tasks)
    frontend.live.add(queue)
    timeout = frontend.limits.request_timeout
    timer = None if timeout is None else asyncio.get_running_loop().call_later(
        max(0.0, job.received + timeout - time.perf_counter()), queue.put_nowait,
        (None, APIError(504, f"the request did not finish within the server's {timeout:g} s timeout "
                             f"(--request-timeout) and was aborted", type="server_error", code="timeout")))
    try:
        while remaining:
            item = await queue.get()
            if isinstance(item, tuple):
                out = item[1]
                if isinstance(out, EngineStopped) or (isinstance(out, RequestError) and frontend.engine_problem()):
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
        frontend.live.discard(queue)
        if timer is not None:
            timer.cancel()
        if remaining:  # the consumer left early (a client that went away): those choices are aborted
            metrics.finished.labels("abort").inc(sum(1 for o in state if o is None or not o.finished))
        for task in tasks:
            task.cancel()  # a cancelled pump closes its generate(), which aborts the request
        # Last: inside a cancelled anyio scope (Starlette's disconnect handling) this await raises again.
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(frontend: Frontend, job: Job) -> list[RequestOutput]:
    """Every choice's final output, in choice order."""
    final: list[RequestOutput | None] = [None] * len(job.configs)
    async for choice, out in outputs(frontend, job):
        if out.finished:
            final[choice] = out
    return cast(list[RequestOutput], final)   # outputs() ends only when every choice has finished


# -- disconnects ----------------------------------------------------------------------------------------------

async def until_done_or_gone(frontend: Frontend, request: Request, job: Job) -> list[RequestOutput] | None:
    """collect(), or None when the client disconnects first (its requests are then aborted)."""
    return await unless_gone(request, collect(frontend, job))


async def unless_gone(request: Request, work):
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


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- server-sent events ---------------------------------------------------------------------------------------

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


def stream_error(exc: Exception) -> APIError:
    """What ends a stream that fails after its 200: its APIError, or for anything else (a bug) a 500, logged with
    its traceback, so that the client still gets the API's error event and the stream's end, not a cut."""
    if isinstance(exc, APIError):
        return exc
    log.error("a stream failed after its 200", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {brief(str(exc), 200)}", type="server_error",
                    code="internal_error")


def sse(data: Mapping[str, object] | str) -> str:
    """An unnamed event, as OpenAI's streams send them: a dict as JSON, or text such as ``[DONE]``."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def event(name: str, data: Mapping[str, object]) -> str:
    """A server-sent event with a name (``event:``), as Anthropic's and the Responses API's streams send them."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def event_lines(frontend: Frontend, job: Job, chunks: Chunks, usage_chunk: UsageChunk) -> AsyncIterator[str]:
    """OpenAI's stream of a job: the chunks ``chunks(choice, out, delta, logprobs_from)`` makes of each output
    (none when it holds the text back), ``usage_chunk(final outputs)`` when usage is asked for, [DONE].

    ``out.text`` never shows what may still turn out to be a stop string: the engine holds it back.
    """
    finals: list[RequestOutput | None] = [None] * len(job.configs)   # by choice
    sent_text = [0] * len(job.configs)
    sent_logprobs = [0] * len(job.configs)
    stream = outputs(frontend, job)
    try:
        try:
            async for choice, out in stream:
                if out.finished:
                    finals[choice] = out
                if out.finished and out.finish_reason == "error":
                    yield sse(generation_error(out, choice).body())
                    continue
                delta = out.text[sent_text[choice]:]
                sent_text[choice] += len(delta)
                pieces = chunks(choice, out, delta, sent_logprobs[choice])
                if pieces:
                    sent_logprobs[choice] = len(out.logprobs)
                for piece in pieces:
                    if job.continuous_usage:
                        prompt = len(job.prompt_of(choice))
                        so_far: Usage = {"prompt_tokens": prompt, "completion_tokens": len(out.token_ids),
                                         "total_tokens": prompt + len(out.token_ids)}
                        piece["usage"] = so_far
                    yield sse(piece)
        except Exception as exc:  # timeout, shutdown, engine stopped, a bug: the stream still ends properly
            yield sse(stream_error(exc).body())
            yield sse("[DONE]")
            return
        if job.include_usage:
            yield sse(usage_chunk(finals))
        yield sse("[DONE]")
    finally:
        await stream.aclose()
