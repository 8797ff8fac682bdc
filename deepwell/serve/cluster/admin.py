"""Operator routes of a cluster: list the workers, drain one under the quota guard."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from deepwell.serve.engine_client import DrainRefused, EngineClient
from deepwell.serve.errors import ApiError, ErrorShape, error_response


def add_admin_routes(
    app: FastAPI,
    engine: EngineClient,
    authorize: Callable[[Request], None],
    max_utilisation: float,
    drain_timeout: float,
) -> None:
    """`authorize` raises `ApiError` for a request without a valid API key."""

    @app.get("/admin/workers")
    async def workers(request: Request) -> Response:
        try:
            authorize(request)
        except ApiError as error:
            return error_response(ErrorShape.OPENAI, error)
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
                "utilisation_without": _finite(engine.utilisation_without(view.worker_id)),
            }
            for view in engine.workers()
        ]
        return JSONResponse({"max_utilisation": max_utilisation, "workers": views})

    @app.post("/admin/workers/{worker_id}/drain")
    async def drain(worker_id: int, request: Request) -> Response:
        try:
            authorize(request)
            result = await engine.drain(worker_id, max_utilisation, drain_timeout)
        except ApiError as error:
            return error_response(ErrorShape.OPENAI, error)
        except DrainRefused as error:
            return error_response(ErrorShape.OPENAI, ApiError(error.status_code, str(error)))
        return JSONResponse(asdict(result))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
