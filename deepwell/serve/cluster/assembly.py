"""The HTTP process's side of the worker protocol, as parts: the worker pool, the request
router and the latency they record. `assemble_cluster` wires them; it adds no behaviour.

Callers take the part they need: the router to run requests (`generate`), list workers and
drain one; the pool to start, watch, restart and close the workers and to read their load.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepwell.serve.cluster.metrics import RoleLatency
from deepwell.serve.cluster.options import WORKER_CRASHES_PER_REQUEST
from deepwell.serve.cluster.request_router import RequestRouter
from deepwell.serve.cluster.routing import RoutingPolicy, least_outstanding_tokens
from deepwell.serve.cluster.stream_table import StreamTable
from deepwell.serve.cluster.worker_pool import HEARTBEAT_TIMEOUT_S, WorkerPool, WorkerRole


@dataclass(frozen=True)
class Cluster:
    """One per event loop: the pool reports what its workers produce and lose to the router."""

    pool: WorkerPool
    router: RequestRouter
    latency: RoleLatency


def assemble_cluster(
    outbox_address: str,
    inbox_addresses: list[str],
    *,
    roles: list[WorkerRole] | None = None,
    policy: RoutingPolicy = least_outstanding_tokens,
    block_size: int = 128,
    shared_store: bool = False,
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
    hung_timeout: float | None = None,
    join_address: str | None = None,
    eviction_reports: bool = True,
    request_timeout_s: float | None = None,
    crashes_per_request: int = WORKER_CRASHES_PER_REQUEST,
) -> Cluster:
    """`join_address` (tcp://HOST:PORT): where workers started elsewhere connect;
    `shared_store`: the workers share a KV store, so a prefix computed anywhere is a hit;
    `eviction_reports`: routing forgets the prefix blocks workers report evicted;
    `hung_timeout`: the silence allowed the workers of `inbox_addresses` when the caller
    watches their processes (None: `heartbeat_timeout`, as for workers that join);
    `request_timeout_s`: every request's deadline (None: none);
    `crashes_per_request`: worker crashes charged to a request before it fails."""
    latency = RoleLatency()
    roles = roles or [WorkerRole.MIXED] * len(inbox_addresses)
    pool = WorkerPool(
        outbox_address, inbox_addresses, roles, heartbeat_timeout, join_address, hung_timeout
    )
    streams = StreamTable(latency)
    router = RequestRouter(
        pool,
        streams,
        policy,
        block_size,
        shared_store,
        latency,
        eviction_reports,
        request_timeout_s,
        crashes_per_request,
    )
    pool.listen(router)
    return Cluster(pool, router, latency)
