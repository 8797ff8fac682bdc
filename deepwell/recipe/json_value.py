"""JSON values as the reference sees them: checked Python objects and its two JSON spellings.

`py_json` is Python's `json.dumps` look (spec/recipe.md conventions); `compact_json` drops spaces.
"""

from __future__ import annotations

import json
import math
from typing import Any

JsonValue = Any

# The reference's Python→JSON bridge refuses deeper inputs (spec/recipe.md §1, §15.12).
MAX_NESTING = 128
_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1


def check_json_value(value: object, max_depth: int = MAX_NESTING - 1) -> JsonValue:
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


def py_json(value: JsonValue) -> str:
    """`json.dumps(value, ensure_ascii=False)`: the spelling the templates use for schemas."""
    return json.dumps(value, ensure_ascii=False)


def compact_json(value: JsonValue) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
