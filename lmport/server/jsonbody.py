"""Request bodies into request models, the same way on every route: JSON nested deeper than ``MAX_JSON_DEPTH`` is
refused with a 400 that names the limit before any parser recurses into it.

Without the limit, 1000 nested arrays gave a 500 (a RecursionError in ``json.loads``) on the routes whose errors
look at the parsed body, and pydantic's own recursion limit (a 400 in its words) on the others.
"""
from __future__ import annotations

import numpy as np
from fastapi import Request
from pydantic import ValidationError

from lmport.server.protocol import APIError, validation_error

MAX_JSON_DEPTH = 64   # nested arrays and objects; tool schemas and message lists need far fewer

_STRUCTURE = b'"[]{}'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
# What may follow a backslash in a JSON string, with the structure: kept while escapes are read.
_NOT_ESCAPES = bytes(b for b in range(256) if b not in _STRUCTURE + b'\\/bfnrtu')


def depth(body: bytes) -> int:
    """How deep ``body``'s arrays and objects nest (exact for valid JSON, an estimate for a body that is not).

    Brackets inside strings do not nest, so the body is cut down to its quotes and brackets, each string left as
    two quotes. A body with backslashes first loses its escaped quotes: every byte goes but the structure and what
    may follow a backslash (each escape keeps its two bytes side by side), then escaped backslashes, then escaped
    quotes. Each step is one pass in C that keeps few bytes, so even a body of large base64 images is measured on
    the event loop without holding it long."""
    if b"\\" in body:
        body = body.translate(None, _NOT_ESCAPES).replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = body.translate(None, _NOT_STRUCTURE)
    if not skeleton:
        return 0
    codes = np.frombuffer(skeleton, np.uint8)
    outside = np.cumsum(codes == ord('"')) % 2 == 0   # false from a string's opening quote to its closing one
    steps = (((codes == ord("[")) | (codes == ord("{"))).astype(np.int32) * 2 - 1) * outside   # +1 opens, -1 closes
    steps[codes == ord('"')] = 0
    return max(0, int(np.cumsum(steps).max()))


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
