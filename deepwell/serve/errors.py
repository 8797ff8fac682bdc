"""HTTP errors in each dialect's shape: OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", ...}`.

Conversion errors keep the recipe's status and, on OpenAI routes, its exact body
(spec/recipe.md §1, §11).
"""

from __future__ import annotations

import enum
import json

from starlette.responses import Response

from deepwell.recipe import ConversionError

# Anthropic's error `type` per status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# OpenAI's `type` / `code` per status; 400 matches the recipe's own errors.
_OPENAI_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("service_unavailable", "service_unavailable"),
}


class ErrorShape(enum.Enum):
    """Which family of clients a route serves; decides error bodies and the API-key header."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class ApiError(Exception):
    """A request the service refuses, with the HTTP status and extra headers to send."""

    def __init__(self, status_code: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.headers = headers or {}


def error_object(shape: ErrorShape, status_code: int, message: str) -> dict:
    """The JSON error body a client of `shape` expects for `status_code`."""
    if shape is ErrorShape.ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(status_code, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind, code = _OPENAI_TYPES.get(status_code, ("internal_error", "internal_error"))
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(shape: ErrorShape, error: ApiError) -> Response:
    body = json.dumps(error_object(shape, error.status_code, error.message), ensure_ascii=False)
    return Response(body, error.status_code, error.headers, media_type="application/json")


def conversion_error_response(shape: ErrorShape, error: ConversionError) -> Response:
    if shape is ErrorShape.OPENAI:
        return Response(error.body, error.status_code, media_type="application/json")
    message = json.loads(error.body)["error"]["message"]
    return error_response(shape, ApiError(error.status_code, message))
