"""Which JSON-schema keywords the grammar enforces, checked against the installed llguidance."""

import json

import pytest

from deepwell.serve.schema_coverage import unenforced_keywords

ARRAY = {"type": "array", "items": {"type": "integer"}}


def field(schema: dict) -> str:
    return json.dumps({"type": "object", "properties": {"a": schema}, "required": ["a"]})


@pytest.mark.parametrize(
    "schema",
    [
        {**ARRAY, "minItems": 1, "maxItems": 3},
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        {"type": "string", "minLength": 1, "maxLength": 4},
        {"type": "string", "pattern": "^[a-z]+$"},
        {"enum": ["x", 1, None]},
        {"const": "x"},
        {"type": "integer", "minimum": 0, "maximum": 9, "multipleOf": 3},
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        {"type": "object", "minProperties": 1, "maxProperties": 2},
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
        {"type": "object", "additionalProperties": False},
        {"anyOf": [{"type": "string"}, {"type": "null"}]},
        {"allOf": [{"type": "string"}, {"maxLength": 3}]},
        {"$ref": "#/$defs/d"},
        *({"type": "string", "format": name} for name in ("date-time", "date", "time")),
        *({"type": "string", "format": name} for name in ("duration", "email", "hostname")),
        *({"type": "string", "format": name} for name in ("ipv4", "ipv6", "uri", "uuid")),
    ],
)
def test_keywords_the_grammar_enforces(schema):
    text = json.loads(field(schema))
    text["$defs"] = {"d": {"type": "integer", "maximum": 3}}
    assert unenforced_keywords(json.dumps(text)) == []


@pytest.mark.parametrize(
    ("schema", "keywords"),
    [
        ({**ARRAY, "uniqueItems": True}, ["uniqueItems"]),
        ({**ARRAY, "contains": {"const": 1}, "minContains": 1}, ["contains", "minContains"]),
        ({"not": {"const": 1}}, ["not"]),
        ({"if": {"type": "string"}, "then": {"maxLength": 2}}, ["if", "then"]),
        ({"type": "object", "propertyNames": {"maxLength": 2}}, ["propertyNames"]),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, ["dependentRequired"]),
        ({"type": "object", "unevaluatedProperties": False}, ["unevaluatedProperties"]),
        ({"type": "string", "format": "uri-reference"}, ["format:uri-reference"]),
        ({"type": "string", "format": "idn-email"}, ["format:idn-email"]),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["oneOf"]),
    ],
)
def test_keywords_the_grammar_skips_are_named(schema, keywords):
    assert sorted(unenforced_keywords(field(schema))) == sorted(keywords)


def test_a_keyword_name_cannot_break_the_header():
    schema = {"type": "string", "format": "a,b\r\nx-evil: 1\u00e9"}
    (keyword,) = unenforced_keywords(field(schema))
    assert keyword.isascii() and keyword.isprintable() and "," not in keyword


def test_a_schema_the_engine_refuses_names_nothing():
    assert unenforced_keywords("true") == []
    assert unenforced_keywords(field({"type": "nope"})) == []
