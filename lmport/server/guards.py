"""Cross-site guards, as plain ASGI middleware in front of the app.

* Host check: a server bound to loopback answers only requests whose ``Host``
  is the bound address, ``localhost`` or a name in ``allowed_hosts``, so a web
  page that rebinds its own DNS name to 127.0.0.1 cannot read responses.
* Content type: a POST must be ``application/json``. Browsers send
  ``text/plain`` (and form types) cross-site without a CORS preflight; JSON
  needs one, which the server refuses unless ``--cors-origins`` allows it.
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Mapping

from lmport.server.protocol import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def host_name(header: str) -> str:
    """``example.com:8080`` -> ``example.com``; ``[::1]:80`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_host_names(bind_host: str, allowed_hosts: list[str] | None) -> set[str] | None:
    """The Host names to accept, or None for any (not bound to loopback, or ``*`` allowed)."""
    extra = [h.strip().lower() for h in (allowed_hosts or [])]
    if "*" in extra or (not is_loopback(bind_host) and not extra):
        return None
    names = {*extra, host_name(bind_host)}
    if is_loopback(bind_host):
        names.update(LOOPBACK_NAMES)
    return names


class Guards:
    def __init__(self, app, allowed_hosts: set[str] | None, json_paths: frozenset[str] | None = None,
                 error_body: Callable[[str, APIError], Mapping[str, object]] | None = None):
        """``error_body(path, error)``: an error in the shape of the API that ``path`` belongs to."""
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.error_body = error_body or (lambda path, exc: exc.body())
        # The routes that take a JSON body; a POST elsewhere goes on to the router (404 or 405 with Allow).
        self.json_paths = json_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.allowed_hosts:
                shown = host if len(host) <= 80 else host[:77] + "..."
                return await self._error(scope, send, 421, f"Host {shown!r} is not served here; allowed: "
                                                           f"{', '.join(sorted(self.allowed_hosts))} (add names "
                                                           f"with --allowed-hosts)", "invalid_host")
        if scope["method"] == "POST" and (self.json_paths is None or scope["path"] in self.json_paths):
            media_type = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if media_type != "application/json":
                shown = media_type or "none"
                return await self._error(scope, send, 415, f"Content-Type {shown[:80]!r}: send the body as "
                                                           f"application/json", "unsupported_media_type")
        return await self.app(scope, receive, send)

    async def _error(self, scope, send, status: int, message: str, code: str) -> None:
        body = json.dumps(self.error_body(scope["path"], APIError(status, message, code=code))).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
