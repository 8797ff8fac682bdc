"""JSON as the DeepSeek templates see it: strict parsing of tool-call arguments, V4.1's spelling.

The reference parses arguments with a strict JSON parser. V4 writes values with the reference's
own spelling (`py_json`); V4.1 with Python's `json.dumps(ensure_ascii=False)` (spec §15.4).
"""

from __future__ import annotations

import json

from deepwell.recipe.json_value import JsonValue, is_serde_value, json_int


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_arguments(text: str) -> dict[str, JsonValue] | None:
    """The arguments as a JSON object, or None when strict JSON would not accept an object.

    Lenient inputs Python's `json` takes (NaN, Infinity, 1e400, lone surrogate escapes,
    very deep nesting) count as not JSON (spec/recipe.md §15.6).
    """
    try:
        value = json.loads(text, parse_int=json_int, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not is_serde_value(value):
        return None
    return value


def python_json(value: JsonValue) -> str:
    """Python's own `json.dumps(value, ensure_ascii=False)`: V4.1 spells floats this way."""
    return json.dumps(value, ensure_ascii=False)
