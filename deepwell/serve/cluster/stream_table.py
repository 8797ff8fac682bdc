"""Requests in flight, by id: where each runs, what it has produced, and its output queue.

Outputs and failures are delivered to the queue the request's `generate` reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepwell.engine.outputs import RequestOutput
from deepwell.serve.cluster.inference_errors import (
    InferenceError,
    RequestRejected,
    RequestStalled,
)
from deepwell.serve.cluster.metrics import RoleLatency
from deepwell.serve.messages import GenerateRequest

if TYPE_CHECKING:
    from deepwell.serve.cluster.worker_pool import Worker


@dataclass
class Stream:
    request: GenerateRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker: Worker | None = None
    # Tokens the client has been given; a continuation appends them to the prompt.
    produced: list[int] = field(default_factory=list)
    # True while the prompt runs alone on a prefill worker (max_tokens 1).
    prefilling: bool = False
    dispatched_at: float = 0.0
    last_output_at: float | None = None
    # Worker crashes charged to the request (request_router.py: `_charged`).
    crashes: int = 0
    # The id its client sees (x-request-id), for the errors it may end with.
    client_request_id: str | None = None


class StreamTable:
    """Request id → `Stream`; a stream's worker lists it in `in_flight` while it runs there."""

    def __init__(self, latency: RoleLatency) -> None:
        self._streams: dict[str, Stream] = {}
        self._latency = latency

    def open(self, request: GenerateRequest) -> Stream:
        stream = Stream(request)
        self._streams[request.request_id] = stream
        return stream

    def open_streams(self) -> list[Stream]:
        return list(self._streams.values())

    def __getitem__(self, request_id: str) -> Stream:
        return self._streams[request_id]

    def on(self, worker: Worker, request_id: str) -> Stream | None:
        """The stream of `request_id` if it still runs on `worker`; outputs of a request
        aborted while the step ran, or moved off a worker taken for dead, have none."""
        stream = self._streams.get(request_id)
        return stream if stream is not None and stream.worker is worker else None

    def num_waiting(self) -> int:
        """Streams running somewhere that have had no output since they were sent there."""
        return sum(
            1 for s in self._streams.values() if s.worker is not None and s.last_output_at is None
        )

    def forget(self, request_id: str) -> bool:
        """Drop a request; False if it was already gone."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        if stream.worker is not None:
            stream.worker.in_flight.discard(request_id)
        return True

    def fail(self, stream: Stream, error: InferenceError) -> None:
        self.forget(stream.request.request_id)
        stream.queue.put_nowait(error)

    def record(self, stream: Stream, output: RequestOutput, role: str) -> None:
        """Count an output's tokens as produced and time them against the dispatch."""
        if output.new_token_ids:
            now = time.perf_counter()
            if stream.last_output_at is None:
                self._latency.first_token.labels(role).observe(now - stream.dispatched_at)
            else:
                per_token = (now - stream.last_output_at) / len(output.new_token_ids)
                self._latency.inter_token.labels(role).observe(per_token)
            stream.last_output_at = now
        stream.produced += output.new_token_ids

    def deliver(self, stream: Stream, output: RequestOutput) -> None:
        stream.queue.put_nowait(output)
        if output.finish_reason is not None:
            self.forget(output.request_id)

    @staticmethod
    async def outputs(stream: Stream) -> AsyncIterator[RequestOutput]:
        """The stream's outputs until it finishes; raises what it failed with."""
        while True:
            output = await stream.queue.get()
            if isinstance(output, InferenceError):
                raise output
            if output.finish_reason == "stuck":
                raise RequestStalled(output.error or "the engine stopped advancing the request")
            if output.finish_reason == "error":
                # The request itself failed in the engine (e.g. its grammar did not compile).
                raise RequestRejected(output.error or "the engine rejected the request")
            yield output
            if output.finish_reason is not None:
                return
