"""The parts of a running app (model, settings, frontend, meters, admission, cluster), one
FastAPI dependency each, so a route names only what it uses.

`create_app` keeps one `ServeParts` on `app.state`; it has no behaviour of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from deepwell.engine.stats import EngineStats
from deepwell.serve.cluster.assembly import Cluster
from deepwell.serve.cluster.request_router import RequestRouter
from deepwell.serve.cluster.worker_pool import WorkerPool
from deepwell.serve.completions import Completions
from deepwell.serve.errors import ApiError
from deepwell.serve.frontend import Frontend
from deepwell.serve.gateway import Gateway
from deepwell.serve.metrics import ServeMetrics
from deepwell.serve.model import ServedModel
from deepwell.serve.settings import ServeSettings
from deepwell.serve.stored_responses import ResponsesState


class Admission:
    """Counts admitted requests against the pending limit, and refuses a request while too
    many wait for their first token (`waiting` reads the router's count); once closed
    (shutting down) it refuses every new one."""

    def __init__(
        self,
        limit: int,
        retry_after: int,
        max_waiting: int | None = None,
        waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.max_waiting = max_waiting
        self._waiting = waiting
        self.pending = 0
        self.closed = False
        # Refusals by limit, for /metrics.
        self.rejected = {"pending": 0, "waiting": 0}

    def close(self) -> None:
        self.closed = True

    def enter(self) -> None:
        retry = {"Retry-After": str(self.retry_after)}
        if self.closed:
            raise ApiError(
                503,
                "The server is shutting down and takes no new requests; retry on another instance.",
                retry,
            )
        if self.pending >= self.limit:
            self.rejected["pending"] += 1
            raise ApiError(
                429,
                f"The server is at capacity ({self.limit} requests in progress); retry later.",
                retry,
            )
        if self.max_waiting is not None and self._waiting() >= self.max_waiting:
            self.rejected["waiting"] += 1
            raise ApiError(
                503,
                f"The server's queue is full ({self.max_waiting} requests wait for their "
                "first token); retry later.",
                retry,
            )
        self.pending += 1

    def leave(self) -> None:
        self.pending -= 1

    def load(self) -> EngineStats:
        """The load `/metrics` shows without workers: the app's own admissions are all there is."""
        return EngineStats(running=self.pending, waiting=0, kv_blocks_used=0, kv_blocks_total=0)


@dataclass(frozen=True)
class ServeParts:
    """`cluster` is None on a server without workers (`--mock`, a custom inference source);
    `completions` is None unless raw-prompt completions can run (workers and a tokenizer)."""

    model: ServedModel
    settings: ServeSettings
    frontend: Frontend
    metrics: ServeMetrics
    gateway: Gateway
    admission: Admission
    cluster: Cluster | None
    completions: Completions | None
    responses: ResponsesState
    # When the app started: the `created` time of every model entry.
    created: int


def _parts(request: Request) -> ServeParts:
    return request.app.state.parts


def _model(request: Request) -> ServedModel:
    return _parts(request).model


def _settings(request: Request) -> ServeSettings:
    return _parts(request).settings


def _frontend(request: Request) -> Frontend:
    return _parts(request).frontend


def _metrics(request: Request) -> ServeMetrics:
    return _parts(request).metrics


def _gateway(request: Request) -> Gateway:
    return _parts(request).gateway


def _admission(request: Request) -> Admission:
    return _parts(request).admission


def _completions(request: Request) -> Completions | None:
    return _parts(request).completions


def _pool(request: Request) -> WorkerPool | None:
    cluster = _parts(request).cluster
    return cluster.pool if cluster is not None else None


def _router(request: Request) -> RequestRouter:
    cluster = _parts(request).cluster
    # Only routers that `create_app` includes with a cluster (admin) depend on this.
    assert cluster is not None
    return cluster.router


def _responses(request: Request) -> ResponsesState:
    return _parts(request).responses


def _created(request: Request) -> int:
    return _parts(request).created


ModelDep = Annotated[ServedModel, Depends(_model)]
SettingsDep = Annotated[ServeSettings, Depends(_settings)]
FrontendDep = Annotated[Frontend, Depends(_frontend)]
MetricsDep = Annotated[ServeMetrics, Depends(_metrics)]
GatewayDep = Annotated[Gateway, Depends(_gateway)]
AdmissionDep = Annotated[Admission, Depends(_admission)]
CompletionsDep = Annotated[Completions | None, Depends(_completions)]
PoolDep = Annotated[WorkerPool | None, Depends(_pool)]
RouterDep = Annotated[RequestRouter, Depends(_router)]
CreatedDep = Annotated[int, Depends(_created)]
ResponsesDep = Annotated[ResponsesState, Depends(_responses)]
