"""Graceful shutdown and exit on engine failure, around uvicorn.Server.

On SIGTERM or SIGINT the server stops accepting connections (uvicorn), new
requests on open connections get 503, and in-flight requests have
``shutdown_timeout`` seconds to finish; then the rest are aborted: a stream
gets a final error event and ``[DONE]``, a waiting request an error
response. The process then exits 0. A second SIGINT forces an exit.

When the engine core stops and ``exit_on_engine_failure`` is set, the
server shuts down the same way and the process exits non-zero, so a
supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

log = logging.getLogger(__name__)

ENGINE_FAILURE_EXIT_CODE = 3


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, frontend, shutdown_timeout: float, *,
                 exit_on_engine_failure: bool = True):
        # uvicorn's own cut-off only backs ours up: streams end cleanly at shutdown_timeout.
        config.timeout_graceful_shutdown = shutdown_timeout + 5
        super().__init__(config)
        self.frontend = frontend
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        if exit_on_engine_failure:
            frontend.core.on_failure = self.engine_failed

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self._loop is not None:
            log.warning("%s: finishing in-flight requests for up to %.0f s, then aborting them",
                        signal.Signals(sig).name, self.shutdown_timeout)
            self._loop.call_soon_threadsafe(self._start_drain)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            # uvicorn re-raises the signal it caught once the server has stopped, which would end the
            # process with that signal; a graceful shutdown is a normal exit.
            self._captured_signals.clear()

    def _start_drain(self) -> None:
        asyncio.ensure_future(self.frontend.drain(self.shutdown_timeout))

    def engine_failed(self, reason: str) -> None:
        """Called (on the engine client's reader thread) when the engine core stops: shut down, exit non-zero."""
        log.critical("exiting because %s (--no-exit-on-engine-failure keeps the process up)", reason)
        self.exit_code = ENGINE_FAILURE_EXIT_CODE
        self.should_exit = True
