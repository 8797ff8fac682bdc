"""What the three dialect request classes share: body reading and one-shot conversion.

A request converts once; the object is consumed even when conversion fails (spec §1).
"""

from __future__ import annotations

from typing import Any

from deepwell.recipe.dialects.body import BodyError, Schema, Struct, json_schema, load_body
from deepwell.recipe.json_value import JsonValue


class ProtocolRequest:
    """A parsed request body of one dialect, converted at most once."""

    _shape: Struct

    def __init__(self, body: bytes | str | dict) -> None:
        value: JsonValue = load_body(body)
        try:
            self._fields: dict[str, Any] = self._shape(value)
        except BodyError as error:
            raise ValueError(f"invalid request body: {error}") from None
        self._consumed = False

    @classmethod
    def json_schema(cls) -> Schema:
        """The JSON Schema of the bodies this dialect reads (its fields, as the reader has them)."""
        return json_schema(cls._shape)

    @property
    def model(self) -> str:
        return self._fields["model"]

    def _take(self) -> dict[str, Any]:
        """The parsed fields for the one conversion this request allows."""
        if self._consumed:
            raise RuntimeError("protocol request has been consumed")
        self._consumed = True
        return self._fields
