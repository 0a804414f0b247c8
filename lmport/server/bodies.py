"""Every request body read bounded in bytes and in time, on every route, as one ASGI middleware.

The app's ``receive`` is wrapped: bytes are counted as they arrive, so a body over ``max_bytes`` is refused
with 413 (at once by its Content-Length, else the moment it crosses the limit), never read whole first; a body
not complete ``timeout`` seconds after its request arrived gets 408 with ``Connection: close``.

The 413 must reach a client that is still sending: closing a connection with unread bytes in it resets it, and
the reset throws away the answer before the client reads it. So a body declared too large is left to the HTTP
server, which reads and drops what the client declared once the answer is sent (its connection serves on); a
body streamed past the limit is read to its end and dropped (up to twice the limit, within the deadline) before
it is answered; only one longer than that is answered with ``Connection: close``, and its client may find the
connection reset.

A client that goes away mid-body is its own doing, not a server fault: it is logged once at INFO, without a
traceback, and throttled (lmport.server.quiet_log).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.requests import ClientDisconnect

from lmport.server.protocol import APIError
from lmport.server.quiet_log import Throttled

log = logging.getLogger(__name__)
gone_log = Throttled(log)


class BodyLimit:
    def __init__(self, app, max_bytes: int | Callable[[], int], timeout: float):
        """``max_bytes``: the limit, or what gives it at each request (the front end's, which follows its image
        limits)."""
        self.app, self.timeout = app, timeout
        self.max_bytes: Callable[[], int] = max_bytes if callable(max_bytes) else lambda: max_bytes

    @staticmethod
    def _too_large(limit: int, close: bool = False) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {limit} bytes",
                        code="request_too_large", headers={"Connection": "close"} if close else None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout
        limit = self.max_bytes()
        length = dict(scope["headers"]).get(b"content-length", b"")
        received, complete = 0, False

        async def receive_by_deadline():
            try:
                return await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:   # TimeoutError itself only from Python 3.11
                return None

        async def bounded_receive():
            nonlocal received, complete
            if complete:   # the body is in; what follows (a disconnect) has no deadline
                return await receive()
            if length.isdigit() and int(length) > limit:
                raise self._too_large(limit)
            message = await receive_by_deadline()
            if message is None:
                raise APIError(408, f"the request body did not arrive within {self.timeout:g} s",
                               code="body_timeout", headers={"Connection": "close"})
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > limit:
                    raise self._too_large(limit, close=not (complete or await drained(2 * limit)))
            return message

        async def drained(most: int) -> bool:
            """Reads and drops the rest of the body; whether it ended within ``most`` bytes and the deadline."""
            nonlocal received
            while received <= most:
                message = await receive_by_deadline()
                if message is None or message["type"] != "http.request":
                    return False
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return received <= most
            return False

        try:
            await self.app(scope, bounded_receive, send)
        except ClientDisconnect:
            gone_log.log(logging.INFO, "client_gone", "%s %s: the client closed the connection after %d bytes of "
                         "the request body", scope["method"], scope["path"][:100], received)
