"""JSON values as the reference sees them: checked Python objects and its JSON spellings.

`py_json` has Python's `json.dumps` layout, `compact_json` none; both spell numbers as the reference.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

JsonValue = Any

# The reference's Python→JSON bridge takes up to this many nested containers and refuses
# deeper inputs (measured: 128 accepted, 129 raise; spec/recipe.md §15.12).
MAX_NESTING = 128
# serde_json, the reference's reader of JSON text, opens at most this many containers.
TEXT_MAX_NESTING = 127
_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1


def check_json_value(value: object, max_depth: int = MAX_NESTING) -> JsonValue:
    """Validate a Python object as a JSON value and return it as plain dict/list/scalars.

    Raises the reference's errors: circular input is a ValueError, NaN or infinity is a
    ValueError, nesting beyond `max_depth` containers is a RecursionError, an integer
    outside i64/u64 is an OverflowError.
    """
    return _checked(value, 0, max_depth, set())


def _checked(value: object, depth: int, max_depth: int, open_ids: set[int]) -> JsonValue:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        # The reference holds JSON integers as i64 or u64.
        if not _I64_MIN <= value <= _U64_MAX:
            raise OverflowError("integer is outside the JSON number range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("NaN is not a finite JSON number")
        return value
    if isinstance(value, (dict, list, tuple)):
        depth += 1
        if depth > max_depth:
            raise RecursionError(f"JSON input exceeds the maximum nesting depth of {MAX_NESTING}")
        key = id(value)
        if key in open_ids:
            raise ValueError("circular reference in JSON input")
        open_ids.add(key)
        try:
            if isinstance(value, dict):
                out = {}
                for k, v in value.items():
                    if not isinstance(k, str):
                        raise ValueError("dictionary keys must be strings")
                    out[k] = _checked(v, depth, max_depth, open_ids)
                return out
            return [_checked(v, depth, max_depth, open_ids) for v in value]
        finally:
            open_ids.discard(key)
    raise ValueError(f"unsupported type for a JSON value: {type(value).__name__}")


def json_int(digits: str) -> int | float:
    """A JSON integer as serde_json reads it: beyond i64/u64 it is a float; `-0` is -0.0."""
    if digits == "-0":
        return -0.0
    if len(digits) > 20:
        # Outside u64 whatever the digits (and too long for `int` past 4,300 digits).
        return float(digits)
    value = int(digits)
    return value if _I64_MIN <= value <= _U64_MAX else float(digits)


def is_serde_value(value: JsonValue) -> bool:
    """Whether a value Python's `json` read is one serde_json reads as well.

    serde_json refuses what Python's reader lets through: numbers out of range (`1e400`),
    lone surrogate escapes, more than TEXT_MAX_NESTING nested containers. The walk keeps
    its own stack, so no input depth can exhaust Python's.
    """
    stack: list[tuple[JsonValue, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not utf8_encodable(item):
                return False
        elif isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, (dict, list)):
            depth += 1
            if depth > TEXT_MAX_NESTING:
                return False
            if isinstance(item, dict):
                if not all(key.isascii() or utf8_encodable(key) for key in item):
                    return False
                stack.extend((child, depth) for child in item.values())
            else:
                stack.extend((child, depth) for child in item)
    return True


def utf8_encodable(text: str) -> bool:
    """Whether `text` has no lone surrogate, which UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def format_f64(value: float) -> str:
    """A float as the reference writes it, in JSON text and in error messages alike.

    The digits are the shortest that read back (Python's repr); the notation is fixed from
    1e-5 up to 1e16 and otherwise `1.5e-7` / `1.5e+16` with an unpadded exponent. Integral
    floats keep `.0` (`100.0`, `-0.0`). Python's repr differs only for exponents -5 to -9:
    `1e-05` is `0.00001`, `2.5e-08` is `2.5e-8`.
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


def py_json(value: JsonValue) -> str:
    """`json.dumps(value, ensure_ascii=False)` with the reference's float spelling."""
    return _dumps(value, ", ", ": ")


def compact_json(value: JsonValue) -> str:
    """`py_json` without the spaces after `,` and `:`."""
    return _dumps(value, ",", ":")


def _dumps(value: JsonValue, comma: str, colon: str) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(comma, colon))
    # Python's float spelling differs from the reference's only where it writes `e-0`
    # (`1e-05`, `2.5e-08`); any other text is already the reference's.
    if "e-0" not in text:
        return text
    return _STRING_OR_PADDED_FLOAT.sub(_respell, text)


# In `json.dumps` text: a string literal (left as it is), or a float with a padded exponent.
_STRING_OR_PADDED_FLOAT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|-?\d+(?:\.\d+)?e-0\d')


def _respell(match: re.Match[str]) -> str:
    token = match.group()
    return token if token[0] == '"' else format_f64(float(token))
