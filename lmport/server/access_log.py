"""The access log: one line per HTTP request, written when its answer has been sent (a stream: when it ends).

Each line has the method, the route (its path template when one matched, else the path, cut short), the status,
the latency in seconds, the prompt and generated tokens of a generation route, the request id (also sent back in
the ``x-request-id`` and ``request-id`` headers) and the client's address; never a prompt's or a reply's text.
Plain text by default, JSON lines with ``--access-log-format json``; ``--no-access-log`` turns it off
(docs/server.md, "Access log").

The middleware keeps a Record per request in a context variable; the generation routes fill its token counts
(``note_prompts`` once the job is admitted, ``note_output`` as each choice's output grows), so no body is parsed again.
"""
from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("lmport.access")

FORMATS = ("plain", "json")
MAX_ROUTE_CHARS = 100
# A client's own X-Request-Id is kept when it is a short plain token (never text that could forge a log line).
CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass
class Record:
    """What the log line of one request says beyond its status and timing."""
    request_id: str
    prompt_tokens: int | None = None
    outputs: dict[int, int] = field(default_factory=dict)   # generated tokens so far, by choice

    @property
    def output_tokens(self) -> int | None:
        return sum(self.outputs.values()) if self.outputs or self.prompt_tokens is not None else None


_current: contextvars.ContextVar[Record | None] = contextvars.ContextVar("lmport_access_record", default=None)


def request_id() -> str | None:
    """The id of the request being answered, or None outside one (or with the access log off)."""
    record = _current.get()
    return None if record is None else record.request_id


def note_prompts(prompts: list[list[int]]) -> None:
    """The request's prompt tokens (each prompt once, as usage counts them)."""
    record = _current.get()
    if record is not None:
        record.prompt_tokens = sum(len(p) for p in prompts)


def note_output(choice: int, token_ids: list[int]) -> None:
    """A choice's output so far (its token ids; the last call for a choice counts)."""
    record = _current.get()
    if record is not None:
        record.outputs[choice] = len(token_ids)


def counting_body(body):
    """``body(outs)`` (a whole answer's builder, which may run in a worker thread) that first counts every choice's
    final output (None where a choice has none) into this request's record."""
    record = _current.get()

    def counted(outs):
        if record is not None:
            record.outputs.update({c: len(out.token_ids) for c, out in enumerate(outs) if out is not None})
        return body(outs)
    return counted


def counting_chunks(chunks):
    """``chunks(choice, out, ...)`` (a stream's chunk maker) that first counts the choice's output so far."""
    record = _current.get()

    def counted(choice, out, *args):
        if record is not None:
            record.outputs[choice] = len(out.token_ids)
        return chunks(choice, out, *args)
    return counted


class AccessLog:
    """ASGI middleware: times each HTTP request and logs one line when its answer has been sent or has failed."""

    def __init__(self, app, fmt: str = "plain"):
        if fmt not in FORMATS:
            raise ValueError(f"access log format: {fmt!r}; give one of {', '.join(FORMATS)}")
        self.app, self.fmt = app, fmt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        record = Record(_request_id(scope))
        token = _current.set(record)
        status = None
        id_headers = [(b"x-request-id", record.request_id.encode()), (b"request-id", record.request_id.encode())]

        async def send_logged(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *id_headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        except BaseException:
            status = status or 500   # what the client is answered, by the server's last-resort handler
            raise
        finally:
            _current.reset(token)
            self.write(scope, status, time.perf_counter() - started, record)

    def write(self, scope, status: int | None, seconds: float, record: Record) -> None:
        route = _route(scope)
        client = scope.get("client")
        address = f"{client[0]}:{client[1]}" if client else "-"
        if self.fmt == "json":
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            log.info("%s", json.dumps({"time": now, "method": scope["method"], "route": route, "status": status,
                                       "latency_s": round(seconds, 6), "tokens_in": record.prompt_tokens,
                                       "tokens_out": record.output_tokens, "request_id": record.request_id,
                                       "client": address}))
        else:
            log.info("%s %s %s %s %.3fs in=%s out=%s id=%s", address, scope["method"], json.dumps(route),
                     "-" if status is None else status, seconds, _count(record.prompt_tokens),
                     _count(record.output_tokens), record.request_id)


def _request_id(scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if CLIENT_ID.match(text):
                return text
    return f"req_{uuid.uuid4().hex}"


def _route(scope) -> str:
    """The matched route's path template (no client text), else the request's path cut to MAX_ROUTE_CHARS."""
    route = getattr(scope.get("route"), "path", None)
    path = route if isinstance(route, str) else scope.get("path", "")
    return path if len(path) <= MAX_ROUTE_CHARS else path[:MAX_ROUTE_CHARS - 3] + "..."


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def configure(fmt: str | None) -> None:
    """`lmport serve`: access lines in ``fmt`` go to stderr whatever --log-level is (they are INFO lines); None:
    nowhere."""
    log.propagate = False
    log.handlers.clear()
    if fmt is not None:
        handler = logging.StreamHandler(sys.stderr)
        # A JSON line is the whole line (its time is inside); a plain one starts with the time.
        handler.setFormatter(logging.Formatter("%(message)s" if fmt == "json" else "%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    else:
        log.addHandler(logging.NullHandler())
