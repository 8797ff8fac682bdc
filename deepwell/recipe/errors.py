"""Errors a request can fail with, carrying the HTTP status and the dialect-neutral body.

The body is the OpenAI-style error object the reference returns (spec/recipe.md §1).
"""

from __future__ import annotations

from deepwell.recipe.json_value import compact_json


class ConversionError(Exception):
    """A request the protocol layer refuses; `body` is the JSON error text to return."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = compact_json(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_request_error",
                }
            }
        )
