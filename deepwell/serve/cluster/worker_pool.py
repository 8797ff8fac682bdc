"""The engine workers as the HTTP process sees them: sockets, readiness, heartbeats, loss.

One PULL socket receives every worker's outputs and heartbeats; each worker has its own
input socket. What the workers produce and lose goes to a `PoolListener` (the router).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import zmq
import zmq.asyncio

from deepwell.engine.stats import EngineStats, combine_stats
from deepwell.serve.cluster.inference_errors import EngineUnavailable
from deepwell.serve.cluster.prefix_index import WorkerPrefixes
from deepwell.serve.messages import (
    Heartbeat,
    ImagesEncoded,
    ModelInfo,
    Shutdown,
    StepOutputs,
    WorkerFailed,
    WorkerReady,
    decode_message,
    encode_message,
)

logger = logging.getLogger(__name__)

# A worker silent this long is taken for dead (its heartbeats come every 0.1 s).
HEARTBEAT_TIMEOUT_S = 1.0
# A worker whose exit this server sees directly (its own process, a Ray actor) is dead the
# moment it exits; its silence only says it may hang, and a long step on a loaded machine
# starves its heartbeat thread for seconds (10 s seen at load 30), so it gets this long.
HUNG_WORKER_TIMEOUT_S = 30.0
WATCH_INTERVAL_S = 0.05


class WorkerRole(Enum):
    """What a worker is asked to do: whole requests, or one side of PD disaggregation."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"
    # Only the vision tower: images in, embeddings out (serve --encoder-workers).
    ENCODER = "encoder"


@dataclass
class Worker:
    worker_id: int
    address: str
    role: WorkerRole
    socket: zmq.Socket
    stats: EngineStats = field(default_factory=lambda: EngineStats(0, 0, 0, 0))
    ready: bool = False
    failure: str | None = None
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)
    prefixes: WorkerPrefixes = field(default_factory=WorkerPrefixes)
    last_seen: float = field(default_factory=time.monotonic)
    # Routing record for /metrics: requests sent here, their prompt tokens and the prefix
    # hit the router expected.
    routed_requests: int = 0
    routed_prompt_tokens: int = 0
    routed_hit_tokens: int = 0
    # Times its process was started again after it was lost (launcher.py).
    restarts: int = 0
    # Its native kernels by name and build state, as its latest heartbeat said.
    kernels: dict[str, str] = field(default_factory=dict)
    # This server started it and sees its exit (hung_timeout applies, not heartbeat_timeout).
    watched: bool = False

    @property
    def live(self) -> bool:
        return self.ready and self.failure is None


class PoolListener(Protocol):
    def step_outputs(self, worker: Worker, message: StepOutputs) -> None:
        """A live worker's engine step: its outputs and the requests it refused."""

    def images_encoded(self, worker: Worker, message: ImagesEncoded) -> None:
        """A live encoder worker's embeddings of one request's images."""

    def worker_removed(self, worker: Worker, reason: str, failed: bool) -> None:
        """`worker` is out of service; its `in_flight` requests need another."""


class WorkerPool:
    """The workers, by id; one per HTTP process and event loop."""

    def __init__(
        self,
        outbox_address: str,
        inbox_addresses: list[str],
        roles: list[WorkerRole],
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
        join_address: str | None = None,
        hung_timeout: float | None = None,
    ) -> None:
        """`hung_timeout`: the local workers (0..N-1) are watched by their starter, which
        sees them exit, and are given up on after this much silence (None: they are not
        watched, and `heartbeat_timeout` holds for them as for every joined worker)."""
        # Sends go through plain sockets so an abort can be issued from any cleanup path,
        # without awaiting; receiving is asynchronous.
        self._context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._outbox = self._async_context.socket(zmq.PULL)
        self._outbox.bind(outbox_address)
        # Where workers started elsewhere connect, its port resolved when given as `*`.
        self.join_address = join_address
        if join_address is not None:
            self._outbox.bind(join_address)
            self.join_address = self._outbox.get(zmq.LAST_ENDPOINT).decode()
        # Local workers are 0..N-1; a worker that joins from elsewhere (`deepwell worker
        # --connect`) names itself with a random id and sends its inbox address.
        self.workers = {
            worker_id: Worker(
                worker_id, address, role, self._connect(address), watched=hung_timeout is not None
            )
            for worker_id, (address, role) in enumerate(zip(inbox_addresses, roles, strict=True))
        }
        self.model: ModelInfo | None = None
        self._heartbeat_timeout = heartbeat_timeout
        self._hung_timeout = hung_timeout if hung_timeout is not None else heartbeat_timeout
        # When the receive loop last found no frame waiting (_watch_heartbeats).
        self._caught_up = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._all_ready = asyncio.Event()
        self._listener: PoolListener | None = None

    def listen(self, listener: PoolListener) -> None:
        self._listener = listener

    def _connect(self, address: str) -> zmq.Socket:
        """A PUSH socket to `address`; "" (a worker that says where in its `WorkerReady`,
        as Ray's do): not connected until then, and nothing is sent to it before."""
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        if address:
            socket.connect(address)
        return socket

    async def start(self, timeout: float) -> ModelInfo:
        """Wait until every worker has loaded its model; raise if one fails or is too slow.

        Returns the model the workers serve (they must all load the same one).
        """
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watch_heartbeats()),
        ]
        try:
            await asyncio.wait_for(self._all_ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"engine workers not ready after {timeout:.0f} s") from None
        failures = [w.failure for w in self.workers.values() if w.failure is not None]
        if failures:
            raise EngineUnavailable(f"engine worker failed to start: {failures[0]}")
        return self.model

    @property
    def healthy(self) -> bool:
        return any(w.live for w in self.workers.values())

    def stats(self) -> EngineStats:
        """Scheduler and KV occupancy, and KV reuse counters, summed over live workers."""
        return combine_stats([w.stats for w in self.workers.values() if w.failure is None])

    def remove(self, worker_id: int, reason: str, failed: bool) -> None:
        """Take a worker out of service (`failed`: it died, else it was drained)."""
        worker = self.workers[worker_id]
        if worker.failure is not None:
            return
        was_ready = worker.ready
        worker.failure = reason
        worker.ready = False
        worker.prefixes.clear()
        # A fresh socket drops frames queued for the dead process, so a restarted worker
        # at the same address does not run requests that moved elsewhere.
        worker.socket.close(linger=0)
        worker.socket = self._connect(worker.address)
        if was_ready and failed:
            logger.warning("engine worker %d lost: %s", worker_id, reason)
        self._listener.worker_removed(worker, reason, failed)
        self._check_all_ready()

    def restarted(self, worker_id: int) -> None:
        """A lost worker's replacement is loading: it rejoins with its `WorkerReady`."""
        worker = self.workers[worker_id]
        worker.failure = None
        worker.ready = False
        worker.restarts += 1
        worker.kernels = {}
        worker.last_seen = time.monotonic()

    async def close(self) -> None:
        """Ask every worker to exit and release the sockets."""
        for worker in self.workers.values():
            if worker.failure is None and worker.address:
                worker.socket.send(encode_message(Shutdown()))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.workers.values():
            # Give queued Shutdown frames a moment to leave before the socket goes.
            worker.socket.close(linger=1000)
        self._outbox.close(linger=0)
        self._context.term()
        self._async_context.term()

    def _ready(self, worker: Worker, message: WorkerReady) -> None:
        if message.inbox_address and message.inbox_address != worker.address:
            # A worker that binds where it runs (a Ray actor, a restart on another node).
            worker.socket.close(linger=0)
            worker.address = message.inbox_address
            worker.socket = self._connect(worker.address)
        if worker.role is WorkerRole.ENCODER:
            # It runs the vision tower only; the engine workers say what the model is.
            worker.ready = True
            worker.failure = None
        elif self.model is not None and message.model != self.model:
            worker.failure = (
                f"refused: it serves {message.model.name} (fingerprint "
                f"{message.model.fingerprint or 'none'}), the cluster serves {self.model.name} "
                f"(fingerprint {self.model.fingerprint or 'none'})"
            )
            logger.error("engine worker %d %s", worker.worker_id, worker.failure)
            worker.socket.send(encode_message(Shutdown(worker.failure)))
        else:
            self.model = message.model
            worker.ready = True
            worker.failure = None
            worker.stats = message.stats
            if self._all_ready.is_set():
                logger.info("engine worker %d joined", worker.worker_id)
        self._check_all_ready()

    def _check_all_ready(self) -> None:
        workers = self.workers.values()
        if workers and all(w.ready or w.failure is not None for w in workers):
            self._all_ready.set()

    def _join(self, message: WorkerReady) -> Worker | None:
        """Register a worker that connected on its own; None if it cannot be reached."""
        if not message.inbox_address:
            return None
        worker = Worker(
            message.worker_id,
            message.inbox_address,
            WorkerRole.MIXED,
            self._connect(message.inbox_address),
        )
        self.workers[worker.worker_id] = worker
        logger.info("engine worker %d connected from %s", worker.worker_id, worker.address)
        return worker

    def _frames_waiting(self) -> bool:
        # `get`, never `getsockopt`: reading EVENTS clears the socket's edge-triggered file
        # descriptor, and only the asyncio socket's own `get` then wakes a pending `recv`
        # for the frames already queued. `getsockopt` is the plain socket's: after it, the
        # receive loop slept beside queued outputs for good while the worker idled, its
        # requests stranded and /metrics frozen at their last stats (issue 32).
        return bool(self._outbox.get(zmq.EVENTS) & zmq.POLLIN)

    async def _receive_loop(self) -> None:
        backlog = False
        while True:
            if backlog:
                # A frame already queued comes back from `recv` as a finished future, which
                # `await` passes without yielding: under a flood of outputs this loop would
                # starve every other task of the event loop (deadline timers, HTTP handlers).
                await asyncio.sleep(0)
            message = decode_message(await self._outbox.recv())
            backlog = self._frames_waiting()
            worker = self.workers.get(message.worker_id)
            if worker is None and isinstance(message, WorkerReady):
                worker = self._join(message)
            if worker is None:
                continue  # a worker this front end does not know: nothing to route to it
            worker.last_seen = time.monotonic()
            if not backlog:
                self._caught_up = worker.last_seen
            if isinstance(message, Heartbeat):
                worker.kernels = message.kernels
            elif isinstance(message, WorkerReady):
                self._ready(worker, message)
            elif isinstance(message, WorkerFailed):
                self.remove(message.worker_id, message.message, failed=True)
            elif isinstance(message, StepOutputs) and worker.live:
                worker.stats = message.stats
                self._listener.step_outputs(worker, message)
            elif isinstance(message, ImagesEncoded) and worker.live:
                self._listener.images_encoded(worker, message)
            elif not isinstance(message, (StepOutputs, ImagesEncoded)):
                raise TypeError(f"frontend cannot handle {type(message).__name__}")

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            # With frames waiting, this process (a busy event loop), not the workers, may
            # have fallen behind: silence counts only up to the last moment every frame
            # sent had been read. (Skipping the check while frames wait starved it: live
            # workers' heartbeats keep the socket busy on a loaded machine.)
            now = time.monotonic()
            if self._frames_waiting():
                now = self._caught_up
            for worker in self.workers.values():
                silent = now - worker.last_seen
                # Giving up on the only live worker cannot save its requests, and on a
                # starved machine its silence may only be slowness: it is left to finish.
                others = any(w.live for w in self.workers.values() if w is not worker)
                limit = self._hung_timeout if worker.watched else self._heartbeat_timeout
                if worker.live and others and silent > limit:
                    self.remove(worker.worker_id, f"no heartbeat for {silent:.1f} s", True)
