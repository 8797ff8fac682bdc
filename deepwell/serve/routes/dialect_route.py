"""Routes that answer every failure in their clients' error shape.

A client error (`CLIENT_ERRORS`) keeps its status and message; anything else is a bug, a 500
with a logged request id. FastAPI's own request validation keeps its usual answer. A path no
route serves, or a method its route does not take, is answered by `unrouted_response` in
the shape of the family its path belongs to.
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
    ApiError,
    ErrorShape,
    client_error_response,
    error_response,
    internal_error_response,
)

# Anthropic's SDK calls these paths; every other path answers OpenAI's shape, as vLLM does.
_ANTHROPIC_PATHS = "/v1/messages"
_UNROUTED_MESSAGES = {
    404: "No route {path}; the API serves /v1/chat/completions, /v1/responses, /v1/messages, "
    "/v1/completions and /v1/models.",
    405: "{path} does not take {method}; use {allowed}.",
}


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


def shape_of_path(path: str) -> ErrorShape:
    return ErrorShape.ANTHROPIC if path.startswith(_ANTHROPIC_PATHS) else ErrorShape.OPENAI


async def unrouted_response(request: Request, error: HTTPException) -> Response:
    """The app's answer to a routing failure (an unknown path, a method the path does not
    take) and to any HTTPException a route lets through, in the path's dialect shape."""
    headers = dict(error.headers or {})
    template = _UNROUTED_MESSAGES.get(error.status_code)
    if template is None:
        message = str(error.detail)
    else:
        allowed = headers.get("allow", headers.get("Allow", "another method"))
        message = template.format(path=request.url.path, method=request.method, allowed=allowed)
    api_error = ApiError(error.status_code, message, headers)
    return error_response(shape_of_path(request.url.path), api_error)
