"""Is the engine core moving? /health's answer when the core is alive but has stopped making progress.

The core sends a message after every step; the client (``EngineClient.stalled_since``) knows since when it has
had requests in the core and heard nothing back. Past ``--engine-stall-timeout`` seconds of that, /health says
503 with the time it last moved; an idle core (nothing pending) is healthy however long it is silent.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

from lmport.server.shapes import Health


def stall(core, threshold: float) -> Health | None:
    """/health's 503 body when ``core`` has had work pending and made no progress for over ``threshold`` s."""
    stalled_since = getattr(core, "stalled_since", None)   # the data-parallel front end reports its replicas instead
    since = stalled_since() if stalled_since is not None else None
    if since is None:
        return None
    silent = time.monotonic() - since
    if silent <= threshold:
        return None
    when = datetime.fromtimestamp(time.time() - silent, timezone.utc).isoformat(timespec="seconds")
    return {"status": "engine not progressing", "since": when,
            "reason": f"the engine core is not progressing: no step has finished for {silent:.1f} s (since {when}) "
                      f"with requests pending (--engine-stall-timeout {threshold:g} s)"}
