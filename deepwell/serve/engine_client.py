"""The HTTP process's side of the worker protocol: send requests, route token outputs back.

One PULL socket receives every worker's outputs; each worker has its own input socket, so a
request goes to a chosen worker (the least loaded) and later aborts follow it there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from deepwell.serve.messages import (
    AbortRequest,
    GenerateRequest,
    ModelInfo,
    Shutdown,
    StepOutputs,
    TokenOutput,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
    combine_stats,
    decode_message,
    encode_message,
)


class InferenceError(RuntimeError):
    """A request failed in the engine; `status_code` is the HTTP status it maps to."""

    status_code = 503


class EngineUnavailable(InferenceError):
    """No worker can take the request, or its worker went away while it ran."""


class RequestRejected(InferenceError):
    """The engine's own validation refused the request."""

    status_code = 400


@dataclass
class _Worker:
    worker_id: int
    socket: zmq.Socket
    stats: WorkerStats = field(default_factory=lambda: WorkerStats(0, 0, 0, 0))
    ready: bool = False
    failure: str | None = None
    in_flight: set[str] = field(default_factory=set)


@dataclass
class _Stream:
    worker: _Worker
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class EngineClient:
    """Talks to engine workers over ZeroMQ; one instance per HTTP process and event loop."""

    def __init__(self, outbox_address: str, inbox_addresses: list[str]) -> None:
        # Sends go through plain sockets so an abort can be issued from any cleanup path,
        # without awaiting; receiving is asynchronous.
        self._context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._outbox = self._async_context.socket(zmq.PULL)
        self._outbox.bind(outbox_address)
        self._workers: list[_Worker] = []
        for worker_id, address in enumerate(inbox_addresses):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self._workers.append(_Worker(worker_id, socket))
        self._streams: dict[str, _Stream] = {}
        self._receiver: asyncio.Task | None = None
        self._all_ready = asyncio.Event()
        self._model: ModelInfo | None = None

    async def start(self, timeout: float) -> ModelInfo:
        """Wait until every worker has loaded its model; raise if one fails or is too slow.

        Returns the model the workers serve (they all load the same one).
        """
        self._receiver = asyncio.create_task(self._receive_loop())
        try:
            await asyncio.wait_for(self._all_ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"engine workers not ready after {timeout:.0f} s") from None
        failures = [w.failure for w in self._workers if w.failure is not None]
        if failures:
            raise EngineUnavailable(f"engine worker failed to start: {failures[0]}")
        return self._model

    @property
    def healthy(self) -> bool:
        return any(w.ready and w.failure is None for w in self._workers)

    def stats(self) -> WorkerStats:
        """Scheduler and KV occupancy, and KV reuse counters, summed over live workers."""
        return combine_stats([w.stats for w in self._workers if w.failure is None])

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Yield the request's outputs until it finishes; closing early aborts it."""
        live = [w for w in self._workers if w.ready and w.failure is None]
        if not live:
            raise EngineUnavailable("no engine worker is available")
        worker = min(live, key=lambda w: len(w.in_flight))
        stream = _Stream(worker)
        self._streams[request.request_id] = stream
        worker.in_flight.add(request.request_id)
        worker.socket.send(encode_message(request))
        try:
            while True:
                output = await stream.queue.get()
                if isinstance(output, InferenceError):
                    raise output
                if output.finish_reason == "error":
                    # The request itself failed in the engine (e.g. its grammar did not compile).
                    raise RequestRejected(output.error or "the engine rejected the request")
                yield output
                if output.finish_reason is not None:
                    return
        finally:
            if self._forget(request.request_id) and worker.failure is None:
                worker.socket.send(encode_message(AbortRequest([request.request_id])))

    def worker_lost(self, worker_id: int, reason: str) -> None:
        """Fail the worker's requests; called when its process exits unexpectedly."""
        worker = self._workers[worker_id]
        if worker.failure is not None:
            return
        worker.failure = reason
        error = EngineUnavailable(f"engine worker {worker_id} stopped: {reason}")
        for request_id in list(worker.in_flight):
            self._streams[request_id].queue.put_nowait(error)
        if all(w.ready or w.failure is not None for w in self._workers):
            self._all_ready.set()

    async def close(self) -> None:
        """Ask every worker to exit and release the sockets."""
        for worker in self._workers:
            if worker.failure is None:
                worker.socket.send(encode_message(Shutdown()))
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        for worker in self._workers:
            # Give queued Shutdown frames a moment to leave before the socket goes.
            worker.socket.close(linger=1000)
        self._outbox.close(linger=0)
        self._context.term()
        self._async_context.term()

    def _forget(self, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream.worker.in_flight.discard(request_id)
        return True

    async def _receive_loop(self) -> None:
        while True:
            message = decode_message(await self._outbox.recv())
            if isinstance(message, StepOutputs):
                self._workers[message.worker_id].stats = message.stats
                for output in message.outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue  # aborted by the frontend while the step ran
                    stream.queue.put_nowait(output)
                    if output.finish_reason is not None:
                        self._forget(output.request_id)
                for rejected in message.rejected:
                    stream = self._streams.get(rejected.request_id)
                    if stream is not None:
                        self._forget(rejected.request_id)
                        stream.queue.put_nowait(RequestRejected(rejected.message))
            elif isinstance(message, WorkerReady):
                worker = self._workers[message.worker_id]
                worker.ready = True
                worker.stats = message.stats
                self._model = message.model
                if all(w.ready or w.failure is not None for w in self._workers):
                    self._all_ready.set()
            elif isinstance(message, WorkerFailed):
                self.worker_lost(message.worker_id, message.message)
