"""The accumulated Anthropic message reads streamed tool arguments as the reference does.

A `tool_use` block's `input` is the streamed arguments read by strict JSON: numbers, nesting
limits and lone surrogates as in serde_json, spelled back with the reference's float spelling.
"""

from __future__ import annotations

from types import ModuleType

import deepseek_recipe as dr
import pytest

import deepwell.recipe as ours

CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
    '<｜DSML｜parameter name="x" string="false">{value}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


REPEATED = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
    '<｜DSML｜parameter name="x" string="false">{value}</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="x" string="true">kept</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def accumulated_input(recipe: ModuleType, value: str, call: str = CALL) -> object:
    body = {
        "model": "DeepSeek-V4-Pro",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "thinking": {"type": "disabled"},
    }
    converted = recipe.MessagesRequest(body).convert(recipe.ConversionOptions())
    generator = recipe.MessagesRequest.chunk_generator(converted, "id", "m")
    processor = recipe.StreamProcessor(generator, converted.parsing_options)
    response = recipe.MessagesResponse("id", "m", 0, 1, 0)
    events = processor.push(recipe.InferenceChunk.ready())
    events += processor.push(recipe.InferenceChunk.text(call.format(value=value), 5))
    events += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    for event in events:
        response.accumulate(event)
    text = response.to_json()
    # The raw text, not a parsed copy: the float spelling is what is compared.
    start = text.index('"input":')
    return text[start : text.index(',"stop_reason"')]


@pytest.mark.parametrize(
    "value",
    ["1e-5", "1.5e-5", "1e-7", "2.5E-8", "1e16", "1e22", "1e308", "5e-324", "-0", "-0.0", "1e2"]
    + ["18446744073709551616", "1" + "0" * 400, "1e400", "NaN", '"\\ud800"', '"\\u00e9"'],
)
def test_tool_input_numbers_are_read_and_spelled_like_reference(value: str) -> None:
    assert accumulated_input(ours, value) == accumulated_input(dr, value)


@pytest.mark.parametrize("depth", [125, 126, 127, 128, 1000, 100_000])
def test_tool_input_nested_past_127_containers_is_empty_like_reference(depth: int) -> None:
    value = "[" * depth + "]" * depth
    assert accumulated_input(ours, value) == accumulated_input(dr, value)


def test_tool_input_with_127_nested_containers_is_kept() -> None:
    value = "[" * 126 + "]" * 126
    assert accumulated_input(ours, value) == '"input":{"x":' + value + "}}]"


@pytest.mark.parametrize(
    "value", ["1e400", "-1e400", "1" + "0" * 400, '"\\ud800"', "[" * 127 + "]" * 127, "1.5"]
)
def test_tool_input_refused_value_under_a_repeated_key_is_empty_like_reference(value: str) -> None:
    # serde_json keeps a repeated key's last value but reads every one: a value it refuses
    # makes the whole input `{}` even when a later value replaces it (seed 1476).
    got = accumulated_input(ours, value, REPEATED)
    assert got == accumulated_input(dr, value, REPEATED)
    assert got == ('"input":{"x":"kept"}}]' if value == "1.5" else '"input":{}}]')


def test_body_refused_value_under_a_repeated_key_is_refused_like_reference() -> None:
    body = '{"model": 1e400, "model": "m", "max_tokens": 1, "messages": []}'
    messages = []
    for recipe in (ours, dr):
        with pytest.raises(ValueError) as error:
            recipe.MessagesRequest(body)
        messages.append(str(error.value))
    assert (
        messages[0]
        == messages[1]
        == "invalid JSON request: number out of range at line 1 column 15"
    )
