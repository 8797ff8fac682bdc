"""Operator routes of a cluster: list the workers, drain one under the quota guard."""

from __future__ import annotations

import math
from dataclasses import asdict

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from deepwell.serve.cluster.inference_errors import DrainRefused
from deepwell.serve.errors import ApiError, ErrorShape
from deepwell.serve.routes.access import OpenAIKey
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import RouterDep, SettingsDep

router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))


@router.get("/admin/workers")
async def workers(request_router: RouterDep, settings: SettingsDep, _key: OpenAIKey) -> Response:
    views = [
        {
            "worker_id": view.worker_id,
            "role": view.role,
            "live": view.live,
            "failure": view.failure,
            "draining": view.draining,
            "in_flight": view.in_flight,
            "outstanding_tokens": view.outstanding_tokens,
            "kv_blocks_used": view.stats.kv_blocks_used,
            "kv_blocks_total": view.stats.kv_blocks_total,
            # JSON has no infinity: null when no other worker would remain.
            "utilisation_without": _finite(request_router.utilisation_without(view.worker_id)),
        }
        for view in request_router.views()
    ]
    return JSONResponse({"max_utilisation": settings.drain_max_utilisation, "workers": views})


@router.post("/admin/workers/{worker_id}/drain")
async def drain(
    worker_id: int, request_router: RouterDep, settings: SettingsDep, _key: OpenAIKey
) -> Response:
    try:
        result = await request_router.drain(
            worker_id, settings.drain_max_utilisation, settings.drain_timeout_s
        )
    except DrainRefused as error:
        raise ApiError(error.status_code, str(error)) from None
    return JSONResponse(asdict(result))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
