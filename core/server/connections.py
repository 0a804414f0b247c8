"""Connection hygiene for uvicorn: a header read timeout, and the settings that bound the rest.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and
answers 503 beyond ``limit_concurrency`` connections, but a client that sends
half its request headers holds its connection forever. ``HeaderTimeoutH11``
closes a connection whose next request's headers are not complete within
``header_timeout`` seconds of the connection opening (or of the previous
response). Body read time is bounded by the app (``Limits.body_timeout``).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass
class ConnectionLimits:
    header_timeout: float = 10.0      # seconds to receive a request's headers
    keep_alive_timeout: float = 5.0   # seconds an idle keep-alive connection stays open
    max_connections: int = 1024       # open connections (and running tasks) beyond which uvicorn answers 503
    max_header_bytes: int = 64 * 1024  # h11's limit on the request line and headers

    def uvicorn_kwargs(self) -> dict:
        header_timeout = self.header_timeout

        class Protocol(HeaderTimeoutH11):
            timeout = header_timeout

        return dict(http=Protocol, timeout_keep_alive=self.keep_alive_timeout,
                    limit_concurrency=self.max_connections, h11_max_incomplete_event_size=self.max_header_bytes)


class HeaderTimeoutH11(H11Protocol):
    timeout = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._start_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._start_header_timer()   # the next request on this connection gets the same time

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.timeout, self._headers_overdue, self.cycle)

    def _headers_overdue(self, cycle_then) -> None:
        # A request whose headers arrived has a new cycle: only a connection still without one is closed.
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()
