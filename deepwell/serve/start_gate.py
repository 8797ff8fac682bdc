"""The HTTP app from the first second of `deepwell serve`, while the engine workers load:
`/health` answers 200 (alive), `/ready` and every other route 503 with `Retry-After`, in the
path's dialect shape; once `open`ed, every request goes to the real app.

Listening before the model is up lets a readiness probe tell starting from dead.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from deepwell.serve.errors import ApiError, error_response
from deepwell.serve.request_log import RequestLog
from deepwell.serve.routes.dialect_route import shape_of_path

# A model load takes seconds to minutes; a client polling faster only adds noise.
STARTING_RETRY_AFTER_S = 5


class StartGate:
    """ASGI app: the starting answers until `open(app)`, then `app` (with its lifespan)."""

    def __init__(self) -> None:
        self._app: ASGIApp | None = None
        self._starting = RequestLog(_answer_starting)
        self._lifespan = contextlib.AsyncExitStack()

    @property
    def app(self) -> FastAPI | None:
        return self._app

    async def open(self, app: FastAPI) -> None:
        # uvicorn ran the lifespan's startup before the app existed: it is entered here and
        # left at the server's shutdown.
        await self._lifespan.enter_async_context(app.router.lifespan_context(app))
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._run_lifespan(receive, send)
            return
        await (self._app or self._starting)(scope, receive, send)

    async def _run_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._lifespan.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _answer_starting(scope: Scope, receive: Receive, send: Send) -> None:
    path = scope.get("path", "")
    response: Response
    if path == "/health":
        response = JSONResponse({"status": "starting"})
    elif path == "/ready":
        response = JSONResponse({"status": "starting"}, status_code=503)
    else:
        error = ApiError(
            503,
            "The server is starting: its model is still loading; retry shortly.",
            {"Retry-After": str(STARTING_RETRY_AFTER_S)},
        )
        response = error_response(shape_of_path(path), error)
    await response(scope, receive, send)
