"""Routes that answer every failure in their clients' error shape.

A client error (`CLIENT_ERRORS`) keeps its status and message; anything else is a bug, a 500
with a logged request id. FastAPI's own request validation keeps its usual answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import Response

from deepwell.serve.errors import (
    CLIENT_ERRORS,
    ErrorShape,
    client_error_response,
    internal_error_response,
)


def dialect_route(shape: ErrorShape) -> type[APIRoute]:
    """The route class of a router whose clients read errors in `shape`."""

    class DialectRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()

            async def answer(request: Request) -> Response:
                try:
                    return await handler(request)
                except CLIENT_ERRORS as error:
                    return client_error_response(shape, error)
                except (HTTPException, RequestValidationError):
                    raise
                except Exception as error:
                    return internal_error_response(shape, request.url.path, error)

            return answer

    return DialectRoute
