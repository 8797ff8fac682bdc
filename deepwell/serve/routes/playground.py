"""The playground: its static page, and the render and replay calls it makes.

The page and its scripts are public; every call they make carries the key the user typed in.
Errors come in the shape of the dialect of the request being rendered or replayed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fastapi import APIRouter, FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from deepwell.serve.errors import CLIENT_ERRORS, ApiError, ErrorShape, client_error_response
from deepwell.serve.frontend import RESPONSES
from deepwell.serve.json_body import json_object
from deepwell.serve.playground import ROUTES, STATIC_DIR, dialect_of, render, replay
from deepwell.serve.routes.access import Body, EitherKey, presented_key
from deepwell.serve.routes.dialect_route import dialect_route
from deepwell.serve.routes.parts import FrontendDep, ResponsesDep, SettingsDep
from deepwell.serve.stored_responses import read_turn

router = APIRouter(route_class=dialect_route(ErrorShape.OPENAI))


async def _playground_root() -> Response:
    return RedirectResponse("/playground/")


def mount_page(app: FastAPI) -> None:
    """The page itself, on a server started with the playground on."""
    app.add_api_route("/playground", _playground_root, methods=["GET"], include_in_schema=False)
    app.mount("/playground", StaticFiles(directory=STATIC_DIR, html=True), "playground")


@router.post("/v1/render")
async def render_prompt(
    request: Request,
    frontend: FrontendDep,
    settings: SettingsDep,
    state: ResponsesDep,
    body: Body,
    dialect: str | None = None,
) -> Response:
    """The prompt a request renders to; a Responses turn continued from a stored one
    renders with its history, as it runs."""
    dialect = dialect_of(body, dialect)
    shape = ROUTES[dialect].shape
    try:
        presented_key(request, settings.api_keys, shape)
        if ROUTES[dialect] is RESPONSES:
            body = read_turn(body, state.store).body
        rendered = await run_in_threadpool(render, frontend, dialect, body)
    except CLIENT_ERRORS as error:
        return client_error_response(shape, error)
    return JSONResponse(asdict(rendered))


@router.post("/v1/replay")
async def replay_output(frontend: FrontendDep, _key: EitherKey, body: Body) -> Response:
    fields = _replay_fields(body)
    dialect = dialect_of(fields.request, fields.dialect)
    try:
        result = await run_in_threadpool(replay, frontend, dialect, fields.request, fields.output)
    except CLIENT_ERRORS as error:
        return client_error_response(ROUTES[dialect].shape, error)
    return JSONResponse(asdict(result))


@dataclass(frozen=True)
class _ReplayFields:
    """The body of `POST /v1/replay`: a request (JSON text or object), its dialect (None:
    guessed) and the raw model output to replay."""

    request: str
    dialect: str | None
    output: str


def _replay_fields(body: bytes) -> _ReplayFields:
    data = json_object(body, "the body must be an object with `request` and `output`")
    request, dialect, output = data.get("request"), data.get("dialect"), data.get("output")
    if isinstance(request, dict):
        request = json.dumps(request)
    if not isinstance(request, str):
        raise ApiError(400, "`request` must be a request body: a JSON object or its text")
    if dialect is not None and not isinstance(dialect, str):
        raise ApiError(400, "`dialect` must be a string")
    if not isinstance(output, str):
        raise ApiError(400, "`output` must be a string: the model's raw output")
    return _ReplayFields(request, dialect, output)
