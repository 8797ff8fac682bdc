"""HTTP errors in each dialect's shape: OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", ...}`.

Client errors (`CLIENT_ERRORS`) name what is wrong with the request; anything else is a bug,
answered 500 with a request id that its logged traceback carries too, never its message.
Conversion errors keep the recipe's status and, on OpenAI routes, its exact body
(spec/recipe.md §1, §11).
"""

from __future__ import annotations

import enum
import json
import logging

from starlette.responses import Response

from deepwell.recipe import ConversionError
from deepwell.recipe.json_value import utf8_encodable
from deepwell.serve.request_log import current_request_id, new_request_id

logger = logging.getLogger(__name__)

# Response headers carrying the id of a failed request: OpenAI's SDK reads `x-request-id`,
# Anthropic's `request-id` (each exposes it as the error's `request_id`).
REQUEST_ID_HEADERS = ("x-request-id", "request-id")

# Anthropic's error `type` per status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# OpenAI's `type` / `code` per status; 400 matches the recipe's own errors.
_OPENAI_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("timeout_error", "request_timeout"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("service_unavailable", "service_unavailable"),
}


class ErrorShape(enum.Enum):
    """Which family of clients a route serves; decides error bodies and the API-key header."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


_MESSAGE = {"type": "string"}
# The JSON Schema of what `error_object` writes, per shape (the API's OpenAPI description).
ERROR_SCHEMAS = {
    ErrorShape.OPENAI: {
        "title": "OpenAIError",
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": _MESSAGE,
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                "required": ["message", "type", "param", "code"],
            }
        },
        "required": ["error"],
    },
    ErrorShape.ANTHROPIC: {
        "title": "AnthropicError",
        "type": "object",
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "properties": {"type": {"type": "string"}, "message": _MESSAGE},
                "required": ["type", "message"],
            },
        },
        "required": ["type", "error"],
    },
}


class ApiError(Exception):
    """A request the service refuses, with the HTTP status and extra headers to send."""

    def __init__(
        self,
        status_code: int,
        message: str,
        headers: dict[str, str] | None = None,
        *,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.headers = headers or {}
        # OpenAI's `param` (the field at fault) and a `code` more precise than the status's.
        self.param = param
        self.code = code


def error_object(
    shape: ErrorShape,
    status_code: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
) -> dict:
    """The JSON error body a client of `shape` expects for `status_code`."""
    if shape is ErrorShape.ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(status_code, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind, default_code = _OPENAI_TYPES.get(status_code, ("internal_error", "internal_error"))
    return {
        "error": {"message": message, "type": kind, "param": param, "code": code or default_code}
    }


def error_response(shape: ErrorShape, error: ApiError) -> Response:
    content = error_object(shape, error.status_code, error.message, error.param, error.code)
    body = json.dumps(content, ensure_ascii=False)
    if not body.isascii() and not utf8_encodable(body):
        # A message that quotes the client's text may hold a lone surrogate: escaped, it is
        # still the same JSON string, and the answer stays a 4xx instead of failing to encode.
        body = json.dumps(content)
    return Response(body, error.status_code, error.headers, media_type="application/json")


def conversion_error_response(shape: ErrorShape, error: ConversionError) -> Response:
    if shape is ErrorShape.OPENAI:
        return Response(error.body, error.status_code, media_type="application/json")
    message = json.loads(error.body)["error"]["message"]
    return error_response(shape, ApiError(error.status_code, message))


# What a request is refused with: the service's own checks and the recipe's refusals. Nothing
# else is the client's fault.
CLIENT_ERRORS = (ApiError, ConversionError)


def client_error_response(shape: ErrorShape, error: ApiError | ConversionError) -> Response:
    if isinstance(error, ConversionError):
        return conversion_error_response(shape, error)
    return error_response(shape, error)


def internal_error_message(request_id: str) -> str:
    return f"Internal server error (request id {request_id}); the server log has the details."


def log_internal_error(where: str, error: BaseException, request_id: str) -> None:
    logger.error("internal error on %s (request id %s)", where, request_id, exc_info=error)


def internal_error_response(shape: ErrorShape, where: str, error: Exception) -> Response:
    """A bug while answering `where`: log its traceback under a fresh request id and answer
    500 with that id; the exception's own text may hold internals, so it stays in the log."""
    request_id = current_request_id() or new_request_id()
    log_internal_error(where, error, request_id)
    headers = dict.fromkeys(REQUEST_ID_HEADERS, request_id)
    return error_response(shape, ApiError(500, internal_error_message(request_id), headers))
