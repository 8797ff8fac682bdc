"""Unauthenticated read-only routes: `/health`, `/metrics` (Prometheus) and `/version`."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

import deepwell
from deepwell.serve.errors import ErrorShape
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import MetricsDep, PoolDep

router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))


@router.get("/health")
async def health(pool: PoolDep) -> Response:
    if pool is not None and not pool.healthy:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(meters: MetricsDep) -> Response:
    return Response(meters.render(), media_type="text/plain; version=0.0.4")


@router.get("/version")
async def version() -> Response:
    return JSONResponse({"version": deepwell.__version__})
