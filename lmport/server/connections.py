"""Connection hygiene for uvicorn: a header read timeout, a bound on output the client has not taken, and the
settings that bound the rest.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and
answers 503 beyond ``limit_concurrency`` connections, but a client that sends
half its request headers holds its connection forever. ``HeaderTimeoutH11``
closes a connection whose next request's headers are not complete within
``header_timeout`` seconds of the connection opening (or of the previous
response). Body read time is bounded by the app (``Limits.body_timeout``).

A client that stops reading is noticed late by its writes alone: the kernel's
socket buffers (megabytes once autotuned) and the transport's buffer absorb
minutes of a stream's output before a write waits, and meanwhile its engine
requests keep generating and holding their admission slots. So the protocol
also watches, once a second, what its client takes: the connection is reset
when output waits and the client has taken none of it for ``send_timeout``
seconds (``taken_bytes``: bytes the client's TCP acknowledged), or when the
bytes written and not yet taken (``unsent_bytes``: the transport's buffer
plus the socket's send queue) stay above ``max_unsent_bytes`` without
shrinking for ``send_timeout`` seconds (a client that reads, but too slowly
to keep up). The app then sees the client gone, which aborts its engine
requests and frees their slots (the disconnect path).

Slow or idle connections cannot crowd out the rest: one client address holds at most
``max_connections_per_address`` connections, and when a new connection would pass either cap, the oldest
connection (of that address, or of all) that has no request admitted is closed to make room: one still
sending its headers or body, or idle between requests. So /health and new requests keep answering, and a
request already admitted (running or streaming) is never the one closed. Only when every connection of the
address holds an admitted request is the new one refused.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from lmport.errors import ConfigError
from lmport.server.quiet_log import Throttled

log = logging.getLogger(__name__)
crowded_log = Throttled(log)

_TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)   # Linux: bytes in a socket's send queue


@dataclass
class ConnectionLimits:
    header_timeout: float = 10.0      # seconds to receive a request's headers
    keep_alive_timeout: float = 5.0   # seconds an idle keep-alive connection stays open
    max_connections: int = 1024       # open connections (and running tasks) beyond which uvicorn answers 503
    max_header_bytes: int = 64 * 1024  # h11's limit on the request line and headers
    max_unsent_bytes: int = 2**20     # output the client has not taken beyond which send_timeout runs
    send_timeout: float = 30.0        # seconds waiting output may go untaken, or stay above max_unsent_bytes
    max_connections_per_address: int = 256  # open connections one client address may hold; 0: no cap

    def __post_init__(self):
        if isinstance(self.max_unsent_bytes, bool) or not isinstance(self.max_unsent_bytes, int) \
                or self.max_unsent_bytes <= 0:
            raise ConfigError(f"max_unsent_bytes must be a positive int, got {self.max_unsent_bytes!r}")
        per_address = self.max_connections_per_address
        if isinstance(per_address, bool) or not isinstance(per_address, int) or per_address < 0:
            raise ConfigError(f"max_connections_per_address must be an int >= 0, got {per_address!r}")

    def uvicorn_kwargs(self) -> dict:
        header_timeout, max_unsent, send_timeout = self.header_timeout, self.max_unsent_bytes, self.send_timeout
        limits = self

        class Protocol(HeaderTimeoutH11):
            timeout = header_timeout
            max_unsent_bytes = max_unsent
            unsent_timeout = send_timeout
            max_connections = limits.max_connections
            max_per_address = limits.max_connections_per_address
            open_connections: dict = {}   # this server's own

        return dict(http=Protocol, timeout_keep_alive=self.keep_alive_timeout,
                    limit_concurrency=self.max_connections, h11_max_incomplete_event_size=self.max_header_bytes)


def unsent_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes written to a connection that its client has not taken: the transport's buffer plus, on Linux, the
    socket's send queue (sent and not yet acknowledged, or not yet sent)."""
    unsent = transport.get_write_buffer_size() if isinstance(transport, asyncio.WriteTransport) else 0
    sock = transport.get_extra_info("socket")
    if sock is not None and _TIOCOUTQ is not None:
        try:
            unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            pass
    return unsent


_BYTES_ACKED = struct.Struct("=Q")   # struct tcp_info's tcpi_bytes_acked (Linux >= 4.1), at byte 120
_BYTES_ACKED_AT = 120


def taken_bytes(transport: asyncio.BaseTransport) -> int | None:
    """Bytes of the connection's output its client has taken (acknowledged by its TCP: its receive buffer had room),
    or None where the platform does not say (Linux's TCP_INFO does)."""
    sock = transport.get_extra_info("socket")
    tcp_info = getattr(socket, "TCP_INFO", None)
    if sock is None or tcp_info is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, 256)
    except OSError:
        return None
    if len(info) < _BYTES_ACKED_AT + _BYTES_ACKED.size:
        return None
    return _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0]


class HeaderTimeoutH11(H11Protocol):
    timeout = 10.0               # header_timeout
    max_unsent_bytes = 2**20
    unsent_timeout = 30.0        # send_timeout
    max_connections = 1024       # uvicorn's limit_concurrency
    max_per_address = 0          # max_connections_per_address; 0: no cap
    open_connections: dict = {}  # protocol -> None, oldest first (uvicorn_kwargs gives each server its own)

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._start_header_timer()
        self._unsent_last = 0                    # unsent bytes at the last check
        self._stalled_since: float | None = None  # since when they are above the limit and not shrinking
        self._taken_last: int | None = None       # bytes the client had taken at the last check
        self._idle_since: float | None = None     # since when output waits and the client takes none of it
        self._unsent_timer = self.loop.call_later(self._check_every(), self._check_unsent)
        self._make_room()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._start_header_timer()   # the next request on this connection gets the same time

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._unsent_timer.cancel()
        self.open_connections.pop(self, None)
        super().connection_lost(exc)

    def _address(self) -> str | None:
        return self.client[0] if self.client else None

    def _admitted(self) -> bool:
        """A request of this connection is running or answering (its body is in, or its response started)."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and (not cycle.more_body or cycle.response_started)

    def _make_room(self) -> None:
        """Keeps this new connection within the per-address and overall caps by closing the oldest connection
        that has no request admitted; refuses this one when every connection of its address has one."""
        mine = [p for p in self.open_connections if p._address() == self._address()]
        if self.max_per_address and len(mine) >= self.max_per_address:
            crowd, cap = mine, f"{self.max_per_address} from {self._address()} (--max-connections-per-address)"
        elif len(self.open_connections) >= self.max_connections - 1:   # uvicorn's 503 counts this one too
            crowd, cap = list(self.open_connections), f"{self.max_connections} (--max-connections)"
        else:
            self.open_connections[self] = None
            return
        victim = next((p for p in crowd if not p._admitted()), None)
        if victim is None and crowd is mine:
            crowded_log.log(logging.WARNING, "refused", "refused a connection: over %s, all with requests running",
                            cap)
            self.transport.close()
            return
        if victim is not None:
            crowded_log.log(logging.WARNING, "closed", "closed the oldest connection without a running request: "
                            "over %s", cap)
            self.open_connections.pop(victim, None)
            victim.transport.close()
        self.open_connections[self] = None

    def _start_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.timeout, self._headers_overdue, self.cycle)

    def _headers_overdue(self, cycle_then) -> None:
        # A request whose headers arrived has a new cycle: only a connection still without one is closed.
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()

    def _check_every(self) -> float:
        return min(1.0, self.unsent_timeout / 4)

    def _check_unsent(self) -> None:
        if self.transport.is_closing():
            return
        unsent, taken, now = unsent_bytes(self.transport), taken_bytes(self.transport), self.loop.time()
        if unsent == 0 or taken is None or taken != self._taken_last:
            self._idle_since = None      # nothing waits, or the client took some (or we cannot tell)
        elif self._idle_since is None:
            self._idle_since = now
        if unsent <= self.max_unsent_bytes or unsent < self._unsent_last:
            self._stalled_since = None   # within the limit, or the client is taking what was written
        elif self._stalled_since is None:
            self._stalled_since = now
        if self._idle_since is not None and now - self._idle_since >= self.unsent_timeout:
            log.warning("reset a connection whose client has taken none of its %d waiting bytes for %.0f s "
                        "(--send-timeout)", unsent, now - self._idle_since)
            self._reset()
            return
        if self._stalled_since is not None and now - self._stalled_since >= self.unsent_timeout:
            log.warning("reset a connection whose client has left more than %d bytes untaken for %.0f s "
                        "(--max-unsent-bytes, --send-timeout)", self.max_unsent_bytes, now - self._stalled_since)
            self._reset()
            return
        self._unsent_last, self._taken_last = unsent, taken
        self._unsent_timer = self.loop.call_later(self._check_every(), self._check_unsent)

    def _reset(self) -> None:
        """Drop the connection and what it holds now: no linger, so the kernel discards its send queue (a RST)
        instead of keeping it for a client that does not read; abort() discards the transport's buffer, where
        close() would wait for it to drain."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()
