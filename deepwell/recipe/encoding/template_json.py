"""JSON as the DeepSeek templates see it: strict parsing of tool-call arguments, V4.1's spelling.

The reference parses arguments with a strict JSON parser. V4 writes values with the reference's
own spelling (`py_json`); V4.1 with Python's `json.dumps(ensure_ascii=False)` (spec §15.4).
"""

from __future__ import annotations

import json

from deepwell.recipe.dialects.json_text import JsonSyntaxError, parse_json_text
from deepwell.recipe.json_value import JsonValue


def parse_arguments(text: str) -> dict[str, JsonValue] | None:
    """The arguments as a JSON object, or None when strict JSON would not accept an object.

    Lenient inputs Python's `json` takes (NaN, Infinity, 1e400, lone surrogate escapes,
    very deep nesting) count as not JSON (spec/recipe.md §15.6), also as the value of a key
    the object repeats: serde_json keeps the last value but reads every one.
    """
    try:
        value = parse_json_text(text)
    except (JsonSyntaxError, UnicodeEncodeError):
        return None
    return value if isinstance(value, dict) else None


def python_json(value: JsonValue) -> str:
    """Python's own `json.dumps(value, ensure_ascii=False)`: V4.1 spells floats this way."""
    return json.dumps(value, ensure_ascii=False)
