"""An engine core process held in a step while its client posts a message longer than the pipe holds
(tests/test_engine_client.py). Run in a fresh interpreter: the core is forked, and a process that has already
run torch on several threads cannot fork safely."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.core import EngineCore
from lmport.engine.client import EngineClient
from lmport.engine.messages import EngineRequest


def main(model: str, work: Path) -> int:
    """0 when the long message was posted at once and the held request then served to its end."""
    armed, stepping, release = work / "armed", work / "stepping", work / "release"
    step = EngineCore.step

    def held_step(self):   # in the core process, forked with this patch
        if armed.exists():
            stepping.touch()
            while not release.exists():
                time.sleep(0.01)
        return step(self)
    EngineCore.step = held_step
    client = EngineClient.start_process(model, EngineConfig(device_type="cpu", cache_max_entry_count=16))
    posted = threading.Event()

    async def scenario():
        outputs = client.generate(EngineRequest("held", [1, 2, 3], GenerationConfig(max_new_tokens=2,
                                                                                    ignore_eos=True)))
        first = asyncio.ensure_future(anext(outputs))
        while not stepping.exists():
            await asyncio.sleep(0.01)
        client.abort("x" * (1 << 20))   # an unknown request's abort, 1 MiB: far more than a pipe's buffer
        posted.set()
        out = await first
        tokens = list(out.delta_token_ids)
        while not out.finished:
            out = await anext(outputs)
            tokens += out.delta_token_ids
        return tokens

    pool = ThreadPoolExecutor(1)
    try:
        armed.touch()
        running = pool.submit(asyncio.run, scenario())
        posted_at_once = posted.wait(60)
        release.touch()
        if not posted_at_once:
            print("posting the long message held the event loop until the core read it")
            return 1
        tokens = running.result(120)
        print("served", tokens)
        return 0 if len(tokens) == 2 else 1
    finally:
        release.touch()
        pool.shutdown()
        client.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
