"""JSON as the DeepSeek templates see it: strict parsing of tool-call arguments, V4.1's spelling.

The reference parses arguments with a strict JSON parser. V4 writes values with the reference's
own spelling (`py_json`); V4.1 with Python's `json.dumps(ensure_ascii=False)` (spec §15.4).
"""

from __future__ import annotations

import json

from deepwell.recipe.json_value import JsonValue

# The reference's parser accepts at most this many nested containers (measured: 127 parse,
# 128 fall back to the raw `arguments` parameter).
MAX_ARGUMENT_DEPTH = 127
_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1


class _NotStrictJson(ValueError):
    pass


def _parse_int(text: str) -> int | float:
    # Integers outside i64/u64 become f64 in the reference; "-0" is a float there too.
    if text == "-0":
        return -0.0
    value = int(text)
    if _I64_MIN <= value <= _U64_MAX:
        return value
    return _parse_float(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotStrictJson("number out of range")
    return value


def _reject_constant(name: str) -> None:
    raise _NotStrictJson(f"{name} is not JSON")


def parse_arguments(text: str) -> dict[str, JsonValue] | None:
    """The arguments as a JSON object, or None when strict JSON would not accept an object.

    Lenient inputs Python's `json` takes (NaN, Infinity, 1e400, lone surrogate escapes,
    very deep nesting) count as not JSON (spec/recipe.md §15.6).
    """
    try:
        value = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_reject_constant,
        )
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not _is_strict(value):
        return None
    return value


def _is_strict(root: dict) -> bool:
    stack: list[tuple[JsonValue, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > MAX_ARGUMENT_DEPTH:
                return False
            for key, item in value.items():
                if _has_surrogate(key):
                    return False
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            if depth > MAX_ARGUMENT_DEPTH:
                return False
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str) and _has_surrogate(value):
            return False
    return True


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def python_json(value: JsonValue) -> str:
    """Python's own `json.dumps(value, ensure_ascii=False)`: V4.1 spells floats this way."""
    return json.dumps(value, ensure_ascii=False)
