"""50 varied JSON schemas for structured output tests, built from a catalogue of fields.

Every field is bounded (string lengths, array sizes, number ranges) so that a small model
finishes its object within a modest token budget.
"""

from __future__ import annotations

FIELDS: list[tuple[str, dict]] = [
    ("name", {"type": "string", "maxLength": 16}),
    ("city", {"type": "string", "minLength": 2, "maxLength": 12}),
    ("code", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}),
    ("email", {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}),
    ("color", {"enum": ["red", "green", "blue"]}),
    ("size", {"type": "string", "enum": ["S", "M", "L", "XL"]}),
    ("age", {"type": "integer", "minimum": 0, "maximum": 120}),
    ("count", {"type": "integer", "minimum": 1, "maximum": 9}),
    ("score", {"type": "number", "minimum": 0, "maximum": 10}),
    ("delta", {"type": "integer", "minimum": -50, "maximum": 50}),
    ("active", {"type": "boolean"}),
    ("note", {"type": ["string", "null"], "maxLength": 10}),
    ("tags", {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}),
    (
        "levels",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 5},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    ("flags", {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}),
    ("version", {"const": "v1"}),
    (
        "point",
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 99},
                "y": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    ),
    (
        "owner",
        {
            "type": "object",
            "properties": {
                "first": {"type": "string", "maxLength": 10},
                "last": {"type": "string", "maxLength": 10},
                "title": {"enum": ["mr", "ms", "dr"]},
            },
            "required": ["first", "last"],
            "additionalProperties": False,
        },
    ),
    (
        "either",
        {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]},
    ),
    (
        "items",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99},
                    "label": {"type": "string", "maxLength": 8},
                },
                "required": ["id", "label"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    ),
]


def schema(index: int) -> dict:
    """Schema number `index`: 2 to 4 catalogue fields, some optional, some nested."""
    width = 2 + index % 3
    picked = [FIELDS[(index * 7 + k * 3) % len(FIELDS)] for k in range(width)]
    properties = dict(picked)
    names = list(properties)
    # Every third schema leaves its last field optional.
    required = names[:-1] if index % 3 == 1 and len(names) > 1 else names
    result = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    if index % 5 == 4:
        # Nest the object one level down.
        result = {
            "type": "object",
            "properties": {"record": result, "ok": {"type": "boolean"}},
            "required": ["record", "ok"],
            "additionalProperties": False,
        }
    return result


SCHEMAS = [schema(i) for i in range(50)]


# Every keyword the grammar enforces, in a schema strict mode also accepts (typed nodes,
# closed objects, all properties required): it runs through all three dialects.
ENFORCED_KEYWORDS = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{2,5}$"},
            "minItems": 2,
            "maxItems": 3,
        },
        "name": {"type": "string", "minLength": 3, "maxLength": 8},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "kind": {"type": "string", "const": "pet"},
        "age": {"type": "integer", "minimum": 1, "maximum": 20},
        "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
        "owner": {"$ref": "#/$defs/person"},
    },
    "required": ["tags", "name", "size", "kind", "age", "score", "owner"],
    "additionalProperties": False,
    "$defs": {
        "person": {
            "type": "object",
            "properties": {
                "first": {"type": "string", "minLength": 1, "maxLength": 8},
                "id": {"type": "integer", "minimum": 100, "maximum": 999},
            },
            "required": ["first", "id"],
            "additionalProperties": False,
        }
    },
}

# Keywords llguidance cannot express, next to enforced ones; accepted, not enforced.
UNENFORCED = ["uniqueItems", "format:uri-reference"]
WITH_UNENFORCED_KEYWORDS = {
    "type": "object",
    "properties": {
        "ids": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 9},
            "minItems": 1,
            "maxItems": 3,
            "uniqueItems": True,
        },
        "link": {"type": "string", "format": "uri-reference", "maxLength": 12},
    },
    "required": ["ids", "link"],
    "additionalProperties": False,
}
