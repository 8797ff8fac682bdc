"""Unauthenticated read-only routes: `/health` (liveness), `/ready` (readiness), `/metrics`
(Prometheus) and `/version`."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

import deepwell
from deepwell.serve.errors import ErrorShape
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import AdmissionDep, MetricsDep, PoolDep

router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))


@router.get("/health")
async def health(pool: PoolDep) -> Response:
    if pool is not None and not pool.healthy:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(pool: PoolDep, admission: AdmissionDep) -> Response:
    """200 while new requests can run: a worker serves the model and no shutdown began
    (before the workers are up, the start gate answers 503; serve/start_gate.py)."""
    if admission.closed:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if pool is not None and not pool.healthy:
        return JSONResponse({"status": "no engine worker is ready"}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics")
async def metrics(meters: MetricsDep) -> Response:
    return Response(meters.render(), media_type="text/plain; version=0.0.4")


@router.get("/version")
async def version() -> Response:
    return JSONResponse({"version": deepwell.__version__})
