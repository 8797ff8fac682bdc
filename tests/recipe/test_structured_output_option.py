"""`ConversionOptions.with_structured_output`: Messages `output_config.format`, off by default."""

import json

import pytest

from deepwell.recipe import ConversionError, ConversionOptions, MessagesRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def messages(output_config: dict) -> MessagesRequest:
    return MessagesRequest(
        {
            "model": "DeepSeek-V4.1-Flash",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
            "output_config": output_config,
        }
    )


def test_the_reference_behaviour_ignores_output_format():
    converted = messages({"format": {"type": "json_schema", "schema": SCHEMA}}).convert(
        ConversionOptions()
    )
    assert converted.inference_options.output_constraint is None
    assert converted.conversation.response_format == "text"


def test_the_option_turns_output_format_into_a_json_constraint():
    options = ConversionOptions().with_structured_output(True)
    converted = messages({"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}})
    converted = converted.convert(options)
    constraint = converted.inference_options.output_constraint
    assert constraint.kind == "json"
    assert json.loads(constraint.schema) == SCHEMA
    assert converted.conversation.response_format == "json_schema"
    assert converted.conversation.reasoning_effort == "low"


@pytest.mark.parametrize(
    "fmt",
    [{"type": "text"}, {"type": "json_schema"}, {"type": "json_schema", "schema": {"type": 3}}],
)
def test_the_option_refuses_a_bad_output_format(fmt):
    options = ConversionOptions().with_structured_output(True)
    with pytest.raises(ConversionError):
        messages({"format": fmt}).convert(options)
