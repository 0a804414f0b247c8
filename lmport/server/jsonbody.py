"""Request bodies into request models, the same way on every route: JSON nested deeper than ``MAX_JSON_DEPTH`` is
refused with a 400 that names the limit before any parser recurses into it.

Without the limit, 1000 nested arrays gave a 500 (a RecursionError in ``json.loads``) on the routes whose errors
look at the parsed body, and pydantic's own recursion limit (a 400 in its words) on the others.
"""
from __future__ import annotations

import re

import numpy as np
from fastapi import Request
from pydantic import ValidationError

from lmport.server.protocol import APIError, validation_error

MAX_JSON_DEPTH = 64   # nested arrays and objects; tool schemas and message lists need far fewer

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)   # brackets inside strings do not nest
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def depth(body: bytes) -> int:
    """How deep ``body``'s arrays and objects nest (an estimate for a body that is not valid JSON). Vectorised:
    a 2 MiB body of brackets takes milliseconds, on the event loop."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, np.uint8)
    steps = ((codes == ord("[")) | (codes == ord("{"))).astype(np.int32) * 2 - 1   # +1 opens, -1 closes
    return int(np.cumsum(steps).max())


def check_depth(body: bytes) -> None:
    if (levels := depth(body)) > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests JSON {levels} levels deep; the server allows at most "
                            f"{MAX_JSON_DEPTH} (nested arrays and objects): flatten it", code="json_too_deep")


async def read(request: Request, cls):
    """The request's body as a ``cls`` request. Its size and arrival time are bounded for every route by
    lmport.server.bodies (413, 408) while it is read."""
    return validate(cls, await request.body())


def validate(cls, body: bytes):
    """``body`` as a ``cls`` request, or a 400 naming the field (or the depth limit)."""
    check_depth(body)
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
