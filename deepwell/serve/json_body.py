"""A request body read as a JSON object, or the 400 that says why it is not one: for the
routes the recipe does not parse (/v1/completions, /tokenize, the playground's replay)."""

from __future__ import annotations

from typing import Any

from deepwell.recipe.dialects.json_text import parse_json_text
from deepwell.serve.errors import ApiError


def json_object(
    body: bytes, not_an_object: str = "the request body must be a JSON object"
) -> dict[str, Any]:
    # The recipe's strict reader, as for the chat routes: a lone surrogate escape or NaN is
    # refused here, not carried into an answer that cannot be encoded.
    try:
        data = parse_json_text(body)
    except ValueError as error:
        raise ApiError(400, f"invalid JSON request: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, not_an_object)
    return data
