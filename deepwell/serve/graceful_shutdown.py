"""SIGTERM and SIGINT on `deepwell serve`: new requests get 503 with `Retry-After`, running
ones get `--shutdown-timeout` seconds to finish, the rest end with the dialect's error event
and are aborted on their workers; once their KV blocks are back, HTTP serving stops.

A second signal ends the wait at once. A signal before the model is up stops the start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from deepwell.serve.routes.parts import ServeParts

logger = logging.getLogger("deepwell.serve")

# How long ended requests may take to send their error event, and the workers to report
# their blocks free (an abort lands between engine steps, and a step of a loaded CPU
# worker can take seconds).
_SETTLE_S = 5.0
_BLOCKS_BACK_S = 15.0
_POLL_S = 0.05


class GracefulShutdown:
    """Turns stop signals into a drain of `parts_of()`'s app (None: still starting), then
    calls `stop`."""

    def __init__(
        self,
        timeout: float,
        parts_of: Callable[[], ServeParts | None],
        stop: Callable[[], None],
    ) -> None:
        self._stop = stop
        self._timeout = timeout
        self._parts_of = parts_of
        self._loop = asyncio.get_running_loop()
        self._requested = asyncio.Event()
        self._hurry = asyncio.Event()

    @property
    def requested(self) -> asyncio.Event:
        return self._requested

    def signal(self) -> None:
        """Called from the signal handler: the first signal starts the shutdown, the next
        ones cut the wait short."""
        self._loop.call_soon_threadsafe(self._signalled)

    def _signalled(self) -> None:
        if self._requested.is_set():
            logger.warning("shutting down now: ending the requests still running")
            self._hurry.set()
        self._requested.set()

    async def run(self) -> None:
        """Wait for a signal, drain, then `stop` the HTTP server."""
        await self._requested.wait()
        parts = self._parts_of()
        if parts is not None:
            await self._drain(parts)
        self._stop()

    async def _drain(self, parts: ServeParts) -> None:
        admission = parts.admission
        admission.close()
        running = admission.pending
        logger.info(
            "shutting down: new requests get 503; %d running get %g s to finish",
            running,
            self._timeout,
        )
        await self._until(lambda: admission.pending == 0, self._timeout, self._hurry)
        unfinished = admission.pending
        cluster = parts.cluster
        if unfinished and cluster is not None:
            ended = cluster.router.end_all(
                f"The server shut down before this request finished (--shutdown-timeout "
                f"{self._timeout:g} s)."
            )
            logger.warning("shutting down: ended %d requests still running", ended)
            await self._until(lambda: admission.pending == 0, _SETTLE_S)
        held = "no workers"
        if cluster is not None:
            pool = cluster.pool
            await self._until(lambda: pool.stats().kv_blocks_used == 0, _BLOCKS_BACK_S)
            held = str(pool.stats().kv_blocks_used)
        logger.info(
            "shutting down: %d of %d requests finished in time; KV blocks held: %s",
            max(0, running - unfinished),
            running,
            held,
        )

    @staticmethod
    async def _until(
        done: Callable[[], bool], timeout: float, cut_short: asyncio.Event | None = None
    ) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            if cut_short is not None and cut_short.is_set():
                return
            await asyncio.sleep(_POLL_S)
