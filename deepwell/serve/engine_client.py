"""The HTTP process's side of the worker protocol: one `EngineClient` per event loop.

It only wires the cluster's parts together: the worker pool (sockets, heartbeats, worker
lifecycle, cluster/worker_pool.py), the router (routing, PD hand-off, failover, drain,
cluster/request_router.py) and the stream table (request id → stream, delivery,
cluster/stream_table.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from deepwell.engine.stats import EngineStats
from deepwell.serve.cluster.inference_errors import (
    DrainRefused,
    EngineUnavailable,
    InferenceError,
    RequestRejected,
)
from deepwell.serve.cluster.metrics import RoleLatency
from deepwell.serve.cluster.request_router import DrainResult, RequestRouter, WorkerView
from deepwell.serve.cluster.routing import RoutingPolicy, least_outstanding_tokens
from deepwell.serve.cluster.stream_table import StreamTable
from deepwell.serve.cluster.worker_pool import HEARTBEAT_TIMEOUT_S, WorkerPool, WorkerRole
from deepwell.serve.messages import (
    AbortRequest,
    GenerateRequest,
    ModelInfo,
    TokenOutput,
    encode_message,
)

# The names the rest of serve imports from here: the client's errors and its views.
__all__ = [
    "DrainRefused",
    "DrainResult",
    "EngineClient",
    "EngineUnavailable",
    "InferenceError",
    "RequestRejected",
    "WorkerRole",
    "WorkerView",
]


class EngineClient:
    """Runs requests on engine workers over ZeroMQ and streams their tokens back."""

    def __init__(
        self,
        outbox_address: str,
        inbox_addresses: list[str],
        *,
        roles: list[WorkerRole] | None = None,
        policy: RoutingPolicy = least_outstanding_tokens,
        block_size: int = 128,
        shared_store: bool = False,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
        join_address: str | None = None,
    ) -> None:
        """`join_address` (tcp://HOST:PORT): where workers started elsewhere connect."""
        self.latency = RoleLatency()
        roles = roles or [WorkerRole.MIXED] * len(inbox_addresses)
        self._pool = WorkerPool(
            outbox_address, inbox_addresses, roles, heartbeat_timeout, join_address
        )
        self._streams = StreamTable(self.latency)
        self._router = RequestRouter(
            self._pool, self._streams, policy, block_size, shared_store, self.latency
        )
        self._pool.listen(self._router)

    async def start(self, timeout: float) -> ModelInfo:
        """Wait until every worker has loaded its model; raise if one fails or is too slow.

        Returns the model the workers serve (they must all load the same one).
        """
        return await self._pool.start(timeout)

    @property
    def healthy(self) -> bool:
        return self._pool.healthy

    def stats(self) -> EngineStats:
        """Scheduler and KV occupancy, and KV reuse counters, summed over live workers."""
        return self._pool.stats()

    def workers(self) -> list[WorkerView]:
        return self._router.views()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Yield the request's outputs until it finishes; closing early aborts it."""
        stream = self._streams.open(request)
        try:
            self._router.dispatch(stream)
            async for output in self._streams.outputs(stream):
                yield output
        finally:
            worker = stream.worker
            if self._streams.forget(request.request_id) and worker is not None and worker.live:
                worker.socket.send(encode_message(AbortRequest([request.request_id])))

    def worker_lost(self, worker_id: int, reason: str) -> None:
        """Take a worker out of service and re-admit its requests on the others."""
        self._pool.remove(worker_id, reason, failed=True)

    def worker_restarted(self, worker_id: int) -> None:
        """A lost worker's replacement is loading: it rejoins with its `WorkerReady`."""
        self._pool.restarted(worker_id)

    def utilisation_without(self, worker_id: int) -> float:
        return self._router.utilisation_without(worker_id)

    async def drain(self, worker_id: int, max_utilisation: float, timeout: float) -> DrainResult:
        """Take a worker out of service without losing a request (spec/deepinfer.md §5)."""
        return await self._router.drain(worker_id, max_utilisation, timeout)

    async def close(self) -> None:
        """Ask every worker to exit and release the sockets."""
        await self._pool.close()
