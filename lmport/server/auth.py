"""The API key check every route but /health depends on (``AUTH``)."""
from __future__ import annotations

import hmac

from fastapi import Depends, Request

from lmport.server.protocol import APIError


def require_key(request: Request) -> None:
    keys = request.app.state.frontend.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if not scheme and "x-api-key" in request.headers:   # where Anthropic's clients send the key
        scheme, token = "bearer", request.headers["x-api-key"]
    token = token.strip().encode()
    # Every key is compared (in constant time), so the time taken does not tell which one nearly matched.
    matches = [hmac.compare_digest(token, key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>` (or "
                            "`X-Api-Key: <key>`)", type="authentication_error", code="invalid_api_key")
    request.state.api_key = keys[matches.index(True)]


AUTH = [Depends(require_key)]
