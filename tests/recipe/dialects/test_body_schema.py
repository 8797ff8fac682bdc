"""What the dialects' body readers say they accept (`json_schema`, the OpenAPI description's
request bodies) against what they read: recorded requests fit, refused shapes do not."""

from __future__ import annotations

import gc

import jsonschema
import pytest

from deepwell.recipe import ChatCompletionRequest, MessagesRequest, ResponsesRequest
from deepwell.recipe.dialects import body as b
from tests.recipe.vector_cases import vectors

MODEL = "DeepSeek-V4.1-Flash"
READERS = {
    "chat": ChatCompletionRequest,
    "responses": ResponsesRequest,
    "messages": MessagesRequest,
}


@pytest.mark.parametrize("reader", READERS.values())
def test_each_request_schema_is_valid_json_schema(reader):
    schema = reader.json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["type"] == "object" and "model" in schema["required"]


def test_combinators_describe_what_they_read():
    assert b.json_schema(b.u8) == {"type": "integer", "minimum": 0, "maximum": 255}
    assert b.json_schema(b.optional(b.string)) == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert b.json_schema(b.sequence(b.variants("a", "b"))) == {
        "type": "array",
        "items": {"type": "string", "enum": ["a", "b"]},
    }
    struct = b.Struct("S", {"x": b.boolean}, ("x",), extensions={"y": b.any_value})
    assert b.json_schema(struct) == {
        "title": "S",
        "type": "object",
        "properties": {"x": {"type": "boolean"}, "y": {}},
        "required": ["x"],
    }
    tagged = b.json_schema(b.Tagged("T", "kind", {"s": struct}))
    (variant,) = tagged["anyOf"]
    assert variant["properties"]["kind"] == {"const": "s"} and variant["required"] == ["kind", "x"]


def test_reading_bodies_leaves_no_schemas_behind():
    body = {"model": MODEL, "messages": [], "tools": [{"type": "web_search", "name": "s"}]}
    MessagesRequest(body)
    gc.collect()
    declared = len(b._SCHEMAS)
    for _ in range(50):
        MessagesRequest(body)  # reads each typed tool's name with a reader made on the spot
    gc.collect()
    assert len(b._SCHEMAS) == declared


def test_every_recorded_request_the_readers_accept_fits_their_schema():
    checked = 0
    for case in vectors()["cases"]:
        reader, body = READERS.get(case.get("dialect")), case.get("request")
        if reader is None or not isinstance(body, dict):
            continue
        try:
            reader(body)
        except ValueError:
            continue
        jsonschema.validate(body, reader.json_schema())
        checked += 1
    assert checked > 50


@pytest.mark.parametrize(
    ("reader", "body"),
    [
        (ChatCompletionRequest, {"model": MODEL, "messages": "Hi"}),
        (ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "robot", "content": ""}]}),
        (ChatCompletionRequest, {"model": MODEL, "messages": [], "top_logprobs": 300}),
        (ChatCompletionRequest, {"model": MODEL, "messages": [], "tool_choice": "sometimes"}),
        (ResponsesRequest, {"model": MODEL, "input": 3}),
        (ResponsesRequest, {"model": MODEL, "reasoning": {"effort": "very"}}),
        (MessagesRequest, {"model": MODEL, "messages": [{"role": "user"}]}),
        (MessagesRequest, {"model": MODEL, "messages": [], "system": 1}),
    ],
)
def test_a_body_the_reader_refuses_for_its_shape_fails_the_schema_too(reader, body):
    with pytest.raises(ValueError, match="invalid request body"):
        reader(body)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, reader.json_schema())
