"""A request body read as a JSON object, or the 400 that says why it is not one: for the
routes the recipe does not parse (/v1/completions, /tokenize, the playground's replay)."""

from __future__ import annotations

import json
from typing import Any

from deepwell.serve.errors import ApiError


def json_object(
    body: bytes, not_an_object: str = "the request body must be a JSON object"
) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError as error:
        raise ApiError(400, f"invalid JSON request: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, not_an_object)
    return data
