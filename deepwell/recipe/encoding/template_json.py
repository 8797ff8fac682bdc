"""JSON as the DeepSeek templates see it: strict parsing of tool-call arguments, Python spelling.

The reference parses arguments with a strict JSON parser and writes values the way Python's
`json.dumps(ensure_ascii=False)` does, except that V4 spells small floats its own way.
"""

from __future__ import annotations

import json
from collections.abc import Callable

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


def v4_float(value: float) -> str:
    """V4's float spelling: Python's repr, but 1e-05 is `0.00001` and exponents are unpadded.

    spec/recipe.md §15.4: `0.00001`, `1e-6`, `-2.5e-8` where Python writes `1e-05`, `1e-06`,
    `-2.5e-08`.
    """
    text = repr(value)
    mantissa, marker, exponent = text.partition("e")
    if not marker:
        return text
    power = int(exponent)
    if power == -5:
        sign = "-" if mantissa.startswith("-") else ""
        return f"{sign}0.0000{mantissa.lstrip('-').replace('.', '')}"
    return f"{mantissa}e{'+' if power > 0 else '-'}{abs(power)}"


def python_json(value: JsonValue, float_spelling: Callable[[float], str] | None = None) -> str:
    """`json.dumps(value, ensure_ascii=False)`, optionally with another float spelling."""
    if float_spelling is None:
        return json.dumps(value, ensure_ascii=False)
    out: list[str] = []
    _write(value, out, float_spelling)
    return "".join(out)


def _write(value: JsonValue, out: list[str], float_spelling: Callable[[float], str]) -> None:
    if isinstance(value, float):
        out.append(float_spelling(value))
    elif isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            if i:
                out.append(", ")
            out.append(json.dumps(key, ensure_ascii=False))
            out.append(": ")
            _write(item, out, float_spelling)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(", ")
            _write(item, out, float_spelling)
        out.append("]")
    else:
        out.append(json.dumps(value, ensure_ascii=False))
