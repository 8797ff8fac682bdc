"""The API's OpenAPI description: what each route reads and answers, for `/openapi.json`
and the `/docs` page (`serve --disable-docs` turns both off).

Request bodies are the JSON Schemas the body readers declare (recipe/dialects/body.py), so
the description is the reader's own; routes carry them as `openapi_extra` and keep reading
their bodies as before. Errors are described in the route's dialect shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.responses import FileResponse, Response

from deepwell.recipe.dialects.body import Schema
from deepwell.serve.errors import ERROR_SCHEMAS, ErrorShape

DOCS_PAGE = Path(__file__).parent / "static" / "docs" / "index.html"
OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
# Where the bodies' fields beyond the dialect's own are listed.
_EXTRA_FIELDS = (
    "Fields beyond these (vLLM's sampling fields, DeepInfer's) are read as docs/serve.md "
    "lists; unknown fields are ignored, as the dialect's reference does."
)
# The refusals every JSON route can answer; their bodies are the dialect's error shape.
_REFUSALS = {
    400: "The body does not parse, or a field is refused (the message names it).",
    401: "Missing or wrong API key.",
    413: "The body is larger than serve --max-body-bytes.",
    415: "The body was not sent as JSON (Content-Type other than application/json).",
    429: "Too many pending requests, or the key's tokens per minute are spent.",
}


def json_body(schema: Schema, *, summary: str) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON request body, described by the reader's schema."""
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "description": _EXTRA_FIELDS,
            "content": {"application/json": {"schema": schema}},
        },
    }


def answers(shape: ErrorShape, *, streams: bool) -> dict[int | str, dict[str, Any]]:
    """A route's `responses`: its answer (JSON, or server-sent events when the body asks
    to stream) and its refusals, in `shape`'s error body."""
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    error = {"application/json": {"schema": ERROR_SCHEMAS[shape]}}
    described: dict[int | str, dict[str, Any]] = {
        200: {"description": "The dialect's response object, or its events.", "content": content}
    }
    for status, why in _REFUSALS.items():
        described[status] = {"description": why, "content": error}
    return described


def serve_docs_page(app: FastAPI) -> None:
    """The `/docs` page: one static file that reads `/openapi.json`, nothing fetched from
    elsewhere (no CDN: a server may have no network)."""

    async def docs_page() -> Response:
        return FileResponse(DOCS_PAGE, media_type="text/html")

    app.add_api_route(DOCS_PATH, docs_page, methods=["GET"], include_in_schema=False)
