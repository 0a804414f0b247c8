"""Logging that a hostile or broken client cannot flood: at most ``burst`` records of one kind per ``period``
seconds; the rest are counted, and the count rides on the next record let through."""
from __future__ import annotations

import logging
import threading
import time


class Throttled:
    def __init__(self, logger: logging.Logger, burst: int = 5, period: float = 60.0, clock=time.monotonic):
        self.logger, self.burst, self.period, self.clock = logger, burst, period, clock
        self._kinds: dict[str, list] = {}   # kind -> [window start, records logged in it, records dropped]
        self._lock = threading.Lock()       # uvicorn's loop and the engine client's threads both log here

    def log(self, level: int, kind: str, msg: str, *args, exc_info=None) -> bool:
        """Logs ``msg % args`` unless ``kind`` already logged ``burst`` records this period; True when logged."""
        now = self.clock()
        with self._lock:
            state = self._kinds.setdefault(kind, [now, 0, 0])
            if now - state[0] >= self.period:
                state[0], state[1] = now, 0
            if state[1] >= self.burst:
                state[2] += 1
                return False
            state[1] += 1
            dropped, state[2] = state[2], 0
        if dropped:
            msg += f" ({dropped} more like it were not logged)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True
