"""Tool parameter schemas: the JSON-Schema meta-schema check and strict-mode normalisation.

Messages follow the reference's validator (spec §6.1); the meta-schema is draft 2020-12.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import unquote

from deepwell.recipe.dialects.body import BodyError, describe, variants
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue, compact_json

# The validator names several allowed types in this fixed order.
_TYPE_ORDER = ("array", "boolean", "integer", "null", "number", "object", "string")
_SIMPLE_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")


class _Invalid(Exception):
    pass


def _json_type(value: JsonValue) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _is_type(value: JsonValue, name: str) -> bool:
    actual = _json_type(value)
    return actual == name or (name == "number" and actual == "integer")


Check = Callable[[JsonValue], None]


def _fail(value: JsonValue, text: str) -> _Invalid:
    return _Invalid(f"{compact_json(value)} {text}")


def _types(*names: str) -> Check:
    def check(value: JsonValue) -> None:
        if not any(_is_type(value, name) for name in names):
            if len(names) == 1:
                raise _fail(value, f'is not of type "{names[0]}"')
            ordered = sorted(names, key=_TYPE_ORDER.index)
            raise _fail(value, "is not of types " + ", ".join(f'"{n}"' for n in ordered))

    return check


def _all(*checks: Check) -> Check:
    def check(value: JsonValue) -> None:
        for item in checks:
            item(value)

    return check


def _when(name: str, inner: Check) -> Check:
    """Apply `inner` only to values of JSON type `name` (keywords ignore other types)."""

    def check(value: JsonValue) -> None:
        if _is_type(value, name):
            inner(value)

    return check


def _minimum(limit: int) -> Check:
    def check(value: JsonValue) -> None:
        if _is_type(value, "number") and value < limit:
            raise _fail(value, f"is less than the minimum of {limit}")

    return check


def _unique(value: JsonValue) -> None:
    if isinstance(value, list):
        seen = [compact_json(item) for item in value]
        if len(set(seen)) != len(seen):
            raise _fail(value, "has non-unique elements")


def _min_items(value: JsonValue) -> None:
    if isinstance(value, list) and not value:
        raise _fail(value, "has less than 1 item")


def _regex_format(value: JsonValue) -> None:
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error:
            raise _fail(value, 'is not a "regex"') from None


def _each_value(inner: Check) -> Check:
    def check(value: JsonValue) -> None:
        if isinstance(value, dict):
            for item in value.values():
                inner(item)

    return check


def _each_key(inner: Check) -> Check:
    def check(value: JsonValue) -> None:
        if isinstance(value, dict):
            for key in value:
                inner(key)

    return check


def _each_item(inner: Check) -> Check:
    def check(value: JsonValue) -> None:
        if isinstance(value, list):
            for item in value:
                inner(item)

    return check


def _schema(value: JsonValue) -> None:
    """A (sub)schema under the 2020-12 meta-schema."""
    _types("object", "boolean")(value)
    if isinstance(value, dict):
        for keyword, check in _KEYWORDS:
            if keyword in value:
                check(value[keyword])


def _type_keyword(value: JsonValue) -> None:
    if isinstance(value, str) and value in _SIMPLE_TYPES:
        return
    if (
        isinstance(value, list)
        and value
        and all(isinstance(item, str) and item in _SIMPLE_TYPES for item in value)
        and len({*value}) == len(value)
    ):
        return
    raise _fail(value, "is not valid under any of the schemas listed in the 'anyOf' keyword")


_string = _types("string")
_non_negative = _all(_types("integer"), _minimum(0))
_schema_array = _all(_types("array"), _min_items, _each_item(_schema))
_string_array = _all(_types("array"), _each_item(_string), _unique)
_schema_map = _all(_types("object"), _each_value(_schema))

# Keyword checks in the order the draft 2020-12 vocabularies list them.
_KEYWORDS: tuple[tuple[str, Check], ...] = (
    # core
    ("$id", _string),
    ("$schema", _string),
    ("$ref", _string),
    ("$anchor", _string),
    ("$dynamicRef", _string),
    ("$dynamicAnchor", _string),
    ("$vocabulary", _all(_types("object"), _each_value(_types("boolean")))),
    ("$comment", _string),
    ("$defs", _schema_map),
    # applicator
    ("prefixItems", _schema_array),
    ("items", _schema),
    ("contains", _schema),
    ("additionalProperties", _schema),
    ("properties", _schema_map),
    ("patternProperties", _all(_types("object"), _each_value(_schema), _each_key(_regex_format))),
    ("dependentSchemas", _schema_map),
    ("propertyNames", _schema),
    ("if", _schema),
    ("then", _schema),
    ("else", _schema),
    ("allOf", _schema_array),
    ("anyOf", _schema_array),
    ("oneOf", _schema_array),
    ("not", _schema),
    # unevaluated
    ("unevaluatedItems", _schema),
    ("unevaluatedProperties", _schema),
    # validation
    ("type", _type_keyword),
    ("enum", _types("array")),
    ("multipleOf", _all(_types("number"), _when("number", lambda v: _positive(v)))),
    ("maximum", _types("number")),
    ("exclusiveMaximum", _types("number")),
    ("minimum", _types("number")),
    ("exclusiveMinimum", _types("number")),
    ("maxLength", _non_negative),
    ("minLength", _non_negative),
    ("pattern", _all(_string, _regex_format)),
    ("maxItems", _non_negative),
    ("minItems", _non_negative),
    ("uniqueItems", _types("boolean")),
    ("maxContains", _non_negative),
    ("minContains", _non_negative),
    ("maxProperties", _non_negative),
    ("minProperties", _non_negative),
    ("required", _string_array),
    ("dependentRequired", _all(_types("object"), _each_value(_string_array))),
    # meta-data, format, content
    ("title", _string),
    ("description", _string),
    ("deprecated", _types("boolean")),
    ("readOnly", _types("boolean")),
    ("writeOnly", _types("boolean")),
    ("examples", _types("array")),
    ("format", _string),
    ("contentEncoding", _string),
    ("contentMediaType", _string),
    ("contentSchema", _schema),
    # draft 2019-09 compatibility keywords kept by the 2020-12 meta-schema
    ("definitions", _schema_map),
    ("dependencies", _all(_types("object"), _each_value(lambda v: _schema_or_strings(v)))),
)


def _positive(value: float) -> None:
    if value <= 0:
        raise _fail(value, "is less than or equal to the minimum of 0")


def _schema_or_strings(value: JsonValue) -> None:
    try:
        _schema(value)
    except _Invalid:
        try:
            _string_array(value)
        except _Invalid:
            raise _fail(
                value, "is not valid under any of the schemas listed in the 'anyOf' keyword"
            ) from None


def check_response_schema(schema: JsonValue) -> None:
    """A (non-strict) `json_schema` response format: any valid JSON Schema."""
    try:
        _schema(schema)
        _check_references(schema, schema)
    except _Invalid as error:
        raise ConversionError(f"Invalid json schema: {error}") from None


# Keywords whose value is a subschema, a list of them, or a map of them.
_SUBSCHEMA = (
    "items", "contains", "additionalProperties", "propertyNames", "if", "then", "else", "not",
    "unevaluatedItems", "unevaluatedProperties", "contentSchema",
)  # fmt: skip
_SUBSCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _check_references(node: JsonValue, root: JsonValue) -> None:
    """Every `$ref` resolves inside the document (nothing is fetched)."""
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str):
        _resolve(ref, root)
    for key in _SUBSCHEMA:
        if key in node:
            _check_references(node[key], root)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for item in node[key]:
                _check_references(item, root)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for item in node[key].values():
                _check_references(item, root)


def _resolve(ref: str, root: JsonValue) -> None:
    if not ref.startswith("#"):
        reason = (
            f"Retrieval is disabled, cannot fetch {ref}"
            if "://" in ref
            else "No base URI is available"
        )
        raise _Invalid(
            f"Resource '{ref}' is not present in a registry and retrieving it failed: {reason}"
        )
    pointer = ref[1:]
    if pointer and not pointer.startswith("/"):
        if not _has_anchor(root, pointer):
            raise _Invalid(f"Anchor '{pointer}' does not exist")
        return
    target = root
    for token in pointer.split("/")[1:]:
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and token in target:
            target = target[token]
        elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
            target = target[int(token)]
        else:
            raise _Invalid(f"Pointer '{pointer}' does not exist")


def _has_anchor(node: JsonValue, name: str) -> bool:
    if isinstance(node, dict):
        if node.get("$anchor") == name:
            return True
        return any(_has_anchor(value, name) for value in node.values())
    if isinstance(node, list):
        return any(_has_anchor(value, name) for value in node)
    return False


def check_parameters_schema(function: str, parameters: JsonValue) -> None:
    """A non-strict tool's parameters: a valid JSON Schema whose type is `object`."""
    try:
        _schema(parameters)
        _check_references(parameters, parameters)
    except _Invalid as error:
        raise ConversionError(f"Invalid schema for function '{function}': {error}") from None
    declared = parameters.get("type") if isinstance(parameters, dict) else None
    if declared != "object":
        raise ConversionError(
            f"Invalid schema for function '{function}': schema must be a JSON Schema of "
            f"'type: \"object\"', got 'type: {compact_json(declared)}'."
        )


# -- strict mode: the schema re-read into the subset constrained decoding supports
_STRICT_TYPES = ("object", "string", "number", "integer", "boolean", "array", "null")
_STRING_FORMATS = ("email", "hostname", "ipv4", "ipv6", "uuid")
_SIMPLE_TYPE = variants("string", "number", "integer", "boolean", "null")


def normalize_strict_schema(schema: JsonValue, *, tool: bool) -> JsonValue:
    """Strict-mode schema: typed subset, closed objects, every property required.

    The top level must be an object, for a tool's parameters and a response format alike.
    """
    try:
        # The whole tree is read (type errors) before any rule is checked.
        _strict_node(schema, nested=not tool, check=False)
    except BodyError as error:
        prefix = "Invalid tool parameters schema : " if tool else "Invalid json schema: "
        raise ConversionError(f"{prefix}{error}") from None
    # Only a tool's top-level object (or its anyOf members) may be empty; the rules are
    # checked through the tree before the top level's type.
    normalized = _strict_node(schema, nested=not tool, check=True)
    if normalized.get("type") != "object":
        what = "function parameters schema" if tool else "json schema"
        raise ConversionError(f"The top level of the {what} must be an object.")
    return normalized


def _strict_node(node: JsonValue, *, nested: bool, check: bool) -> dict:
    if isinstance(node, dict):
        if "type" in node:
            return _strict_typed(node, nested, check)
        if "anyOf" in node:
            try:
                members = _strict_any_of(node["anyOf"], nested, check)
            except BodyError as error:
                raise BodyError(f"field `anyOf`: {error}") from None
            out: dict = {"anyOf": members}
            _copy_description(node, out)
            return out
        if "$ref" in node:
            try:
                return {"$ref": _strict_string(node["$ref"])}
            except BodyError as error:
                raise BodyError(f"field `$ref`: {error}") from None
    raise BodyError("one of `type`, `anyOf`, `$ref` field is required")


def _strict_any_of(options: JsonValue, nested: bool, check: bool) -> list[dict]:
    """anyOf members are typed schemas (no nested anyOf or $ref), as nested as their parent."""
    if not isinstance(options, list):
        raise BodyError(f"invalid type: {describe(options)}, expected a sequence")
    members = []
    for item in options:
        # A member is a tagged type: its tag (`type`, or a sequence's first element) must be
        # a type name; type lists are not allowed here.
        tag = item[0] if isinstance(item, list) and item else None
        if isinstance(item, dict):
            tag = item.get("type")
        if tag is not None and not isinstance(tag, str):
            raise BodyError(f"invalid type: {describe(tag)}, expected variant identifier")
        if isinstance(item, list) or (isinstance(item, dict) and "type" not in item):
            raise BodyError("missing field `type`")
        if not isinstance(item, dict):
            raise BodyError(
                f"invalid type: {describe(item)}, expected internally tagged enum JsonSchemaType"
            )
        members.append(_strict_node(item, nested=nested, check=check))
    return members


def _strict_typed(node: dict, nested: bool, check: bool) -> dict:
    kind = node["type"]
    if isinstance(kind, list):
        # A list of types names simple (scalar) types only.
        try:
            out: dict = {"type": [_SIMPLE_TYPE(name) for name in kind]}
        except BodyError as error:
            raise BodyError(f"field `type`: {error}") from None
        _copy_description(node, out)
        return out
    if not isinstance(kind, str):
        raise BodyError(f"invalid type: {describe(kind)}, expected variant identifier")
    if kind not in _STRICT_TYPES:
        listed = ", ".join(f"`{name}`" for name in _STRICT_TYPES)
        raise BodyError(f"unknown variant `{kind}`, expected one of {listed}")
    out: dict = {"type": kind}
    if kind == "object":
        return _strict_object(node, nested, check)
    _copy_description(node, out)
    if kind == "string":
        for key in ("pattern", "format"):
            if node.get(key) is not None:
                value = _strict_string(node[key])
                if key == "format" and value not in _STRING_FORMATS:
                    listed = ", ".join(f"`{name}`" for name in _STRING_FORMATS)
                    raise BodyError(f"unknown variant `{value}`, expected one of {listed}")
                out[key] = value
        if node.get("enum") is not None:
            values = node["enum"]
            if not isinstance(values, list):
                raise BodyError(f"invalid type: {describe(values)}, expected a sequence")
            out["enum"] = [_strict_string(value) for value in values]
    elif kind in ("number", "integer"):
        for key in (
            "const",
            "default",
            "minimum",
            "maximum",
            "exclusiveMinimum",
            "exclusiveMaximum",
            "multipleOf",
        ):
            if node.get(key) is not None:
                out[key] = _strict_number(node[key], integer=kind == "integer")
    elif kind == "array":
        if "items" not in node:
            raise BodyError("missing field `items`")
        out = {"type": kind, "items": _strict_node(node["items"], nested=True, check=check)}
        _copy_description(node, out)
    return out


def _strict_object(node: dict, nested: bool, check: bool) -> dict:
    """`check`: apply the strict-mode rules (else only read the fields)."""
    properties = node.get("properties")
    if properties is None:
        properties = {}
    if not isinstance(properties, dict):
        raise BodyError(f"invalid type: {describe(properties)}, expected a map")
    normalized = {
        name: _strict_node(value, nested=True, check=check) for name, value in properties.items()
    }
    additional = node.get("additionalProperties")
    if additional is not None and not isinstance(additional, bool):
        raise BodyError(f"invalid type: {describe(additional)}, expected a boolean")
    description = node.get("description")
    if description is not None:
        _strict_string(description)
    required = node.get("required")
    if required is not None:
        if not isinstance(required, list):
            raise BodyError(f"invalid type: {describe(required)}, expected a sequence")
        names = [_strict_string(name) for name in required]
    else:
        names = None
    if check:
        _check_object(normalized, names, additional, nested)
    out: dict = {
        "type": "object",
        "properties": normalized,
        "additionalProperties": False,
        "required": list(normalized),
    }
    if description is not None:
        out["description"] = description
    return out


def _check_object(
    properties: dict, required: list[str] | None, additional: bool | None, nested: bool
) -> None:
    if nested and not properties:
        raise ConversionError("An object with no properties is not allowed.")
    if required is not None:
        seen: set[str] = set()
        for name in required:
            if name not in properties:
                raise ConversionError(f"Required property '{name}' not found in object")
            if name in seen:
                raise ConversionError(f"Duplicate required property '{name}'")
            seen.add(name)
        if len(seen) != len(properties):
            raise ConversionError("Required properties must match all properties in the object")
    if additional is True:
        raise ConversionError("additionalProperties should not be true")


def _copy_description(node: dict, out: dict) -> None:
    if node.get("description") is not None:
        out["description"] = _strict_string(node["description"])


def _strict_string(value: JsonValue) -> str:
    if not isinstance(value, str):
        raise BodyError(f"invalid type: {describe(value)}, expected a string")
    return value


def _strict_number(value: JsonValue, *, integer: bool) -> int | float:
    if integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BodyError(f"invalid type: {describe(value)}, expected i64")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # A `number` schema's numbers are kept as JSON numbers, integers included.
        raise BodyError(f"invalid type: {describe(value)}, expected a JSON number")
    return value


# Keywords whose values are schemas, maps of schemas or lists of schemas (draft 2020-12);
# data keywords (const, enum, default, examples) are not walked.
_SUBSCHEMA = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def strict_output_schema(schema: JsonValue) -> JsonValue:
    """The user's strict schema as the output must match it: every keyword kept, objects closed.

    Strict normalisation keeps a typed subset for the output constraint's text (spec §6.1);
    what strict mode means for the output is only that each object admits exactly its
    properties, all of them required. Applied to a copy, `$defs` included.
    """
    if isinstance(schema, list):
        return [strict_output_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = strict_output_schema(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_output_schema(value) for name, value in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = strict_output_schema(out[key])
    if out.get("type") == "object":
        properties = out.get("properties")
        out["additionalProperties"] = False
        out["required"] = list(properties) if isinstance(properties, dict) else []
    return out
