"""JSON numbers and nesting as the reference reads and writes them.

Expected spellings were measured on deepseek_recipe 0.2.0 (schema text, error messages, V4
prompts); the differential tests compare the same paths on random inputs.
"""

from __future__ import annotations

import json

import pytest

from deepwell.recipe.json_value import (
    check_json_value,
    compact_json,
    format_f64,
    is_serde_value,
    json_int,
    py_json,
)


@pytest.mark.parametrize(
    ("value", "spelled"),
    [
        (0.0, "0.0"),
        (-0.0, "-0.0"),
        (1.0, "1.0"),
        (100.0, "100.0"),
        (0.1, "0.1"),
        (1e-4, "0.0001"),
        (1e-5, "0.00001"),
        (-1.5e-5, "-0.000015"),
        (1e-6, "1e-6"),
        (-2.5e-8, "-2.5e-8"),
        (1e-10, "1e-10"),
        (1e15, "1000000000000000.0"),
        (1e16, "1e+16"),
        (1.5e16, "1.5e+16"),
        (1e22, "1e+22"),
        (1e308, "1e+308"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (5e-324, "5e-324"),
        (2.2250738585072014e-308, "2.2250738585072014e-308"),
        (0.30000000000000004, "0.30000000000000004"),
    ],
)
def test_floats_are_spelled_like_the_reference(value: float, spelled: str) -> None:
    assert format_f64(value) == spelled
    assert compact_json([value]) == f"[{spelled}]"


def test_py_json_keeps_pythons_layout_and_leaves_strings_alone() -> None:
    value = {"a": [1e-5, 1e-7], "s": "1e-05", "n": 2**64 - 1, "é": None}
    assert (
        py_json(value)
        == '{"a": [0.00001, 1e-7], "s": "1e-05", "n": 18446744073709551615, "é": null}'
    )
    assert (
        compact_json(value) == '{"a":[0.00001,1e-7],"s":"1e-05","n":18446744073709551615,"é":null}'
    )


def test_json_without_the_differing_floats_is_pythons_own() -> None:
    value = {"x": [1e16, 5e-324, 0.5, -0.0, 10**19, "e-0"]}
    assert py_json(value) == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize(
    ("digits", "value"),
    [
        ("0", 0),
        ("-0", -0.0),
        ("18446744073709551615", 2**64 - 1),
        ("18446744073709551616", 1.8446744073709552e19),
        ("-9223372036854775808", -(2**63)),
        ("-9223372036854775809", -9.223372036854776e18),
        ("1" + "0" * 5000, float("inf")),
    ],
)
def test_integers_beyond_64_bits_are_floats_and_minus_zero_is_negative(
    digits: str, value: float
) -> None:
    read = json_int(digits)
    assert read == value
    assert type(read) is type(value)
    assert str(read) == str(value)


def nested_lists(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_strict_reading_allows_127_nested_containers() -> None:
    assert is_serde_value(nested_lists(127))
    assert not is_serde_value(nested_lists(128))


def test_strict_reading_of_any_depth_never_exhausts_the_stack() -> None:
    assert not is_serde_value(nested_lists(200_000))


@pytest.mark.parametrize("value", [float("inf"), "\ud800", {"\udc00": 1}, [1, [float("nan")]]])
def test_strict_reading_refuses_what_only_python_reads(value: object) -> None:
    assert not is_serde_value(value)


def test_python_values_take_128_nested_containers() -> None:
    assert check_json_value(nested_lists(128)) == nested_lists(128)
    with pytest.raises(RecursionError, match="maximum nesting depth of 128"):
        check_json_value(nested_lists(129))
