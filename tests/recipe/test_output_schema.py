"""`ConversationRequest.output_schema`: the user's validated schema, every keyword kept.

The output constraint's text stays the reference's normalised subset (the vectors check
it); `output_schema` is what the engine enforces.
"""

import json

import deepseek_recipe
import pytest

from deepwell.recipe import (
    ChatCompletionRequest,
    ConversionOptions,
    MessagesRequest,
    ResponsesRequest,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}},
    "required": ["name"],
}
SCHEMA = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
        "size": {"type": "number", "enum": [1, 2], "uniqueItems": True},
        "owner": {"$ref": "#/$defs/person"},
    },
    "required": ["tags", "size", "owner"],
    "$defs": {"person": PERSON},
}


def chat(schema: dict, strict: bool | None) -> dict:
    json_schema = {"name": "s", "schema": schema}
    if strict is not None:
        json_schema["strict"] = strict
    return {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": "json"}],
        "response_format": {"type": "json_schema", "json_schema": json_schema},
    }


def test_a_strict_schema_keeps_every_keyword_and_closes_its_objects():
    converted = ChatCompletionRequest(chat(SCHEMA, True)).convert(ConversionOptions())
    closed_person = {**PERSON, "additionalProperties": False}
    assert converted.output_schema == {
        **SCHEMA,
        "additionalProperties": False,
        "$defs": {"person": closed_person},
    }
    # The normalised text drops them, byte for byte as the reference does.
    text = converted.inference_options.output_constraint.schema
    assert "minItems" not in text and '"$defs":' not in text


@pytest.mark.parametrize("strict", [None, False, True])
def test_the_output_constraint_text_matches_the_reference(strict):
    body = chat(SCHEMA, strict)
    ours = ChatCompletionRequest(body).convert(ConversionOptions())
    theirs = deepseek_recipe.ChatCompletionRequest(json.dumps(body)).convert(
        deepseek_recipe.ConversionOptions()
    )
    assert ours.inference_options.output_constraint.schema == (
        theirs.inference_options.output_constraint.schema
    )


def test_a_non_strict_schema_is_the_users_own():
    converted = ChatCompletionRequest(chat(SCHEMA, None)).convert(ConversionOptions())
    assert converted.output_schema == SCHEMA


def test_responses_and_messages_carry_the_schema_too():
    responses = ResponsesRequest(
        {
            "model": "DeepSeek-V4.1-Flash",
            "input": "json",
            "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}},
        }
    ).convert(ConversionOptions())
    assert responses.output_schema == SCHEMA
    messages = MessagesRequest(
        {
            "model": "DeepSeek-V4.1-Flash",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "json"}],
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        }
    ).convert(ConversionOptions().with_structured_output(True))
    assert messages.output_schema == SCHEMA


def test_without_a_schema_there_is_none():
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(body).convert(ConversionOptions()).output_schema is None
