"""Typed reading of request bodies: JSON values → dialect fields, with serde's error texts.

A `BodyError` message is what the reference writes after `invalid request body: ` (spec §1).
Every reader also says what it accepts as JSON Schema (`json_schema`), which the server's
OpenAPI description is made of, so the description cannot drift from what is read.
"""

from __future__ import annotations

import math
import struct
import unicodedata
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from deepwell.recipe.dialects.json_text import parse_json_text
from deepwell.recipe.json_value import MAX_NESTING, JsonValue, format_f64

Reader = Callable[[JsonValue], Any]
Schema = dict[str, Any]
_R = TypeVar("_R", bound=Reader)

# What each function reader accepts, built on demand: a hand-written reader may name readers
# defined after it. Struct and Tagged describe themselves. Weak keys: some readers are made
# while a body is read (`optional(string)(value)`), and must not outlive it here.
_SCHEMAS: weakref.WeakKeyDictionary[Reader, Callable[[], Schema]] = weakref.WeakKeyDictionary()


def accepts(schema: Callable[[], Schema]) -> Callable[[_R], _R]:
    """Declares the JSON Schema of what a reader accepts (`json_schema` reads it back)."""

    def declare(reader: _R) -> _R:
        _SCHEMAS[reader] = schema
        return reader

    return declare


def json_schema(reader: Reader) -> Schema:
    """What `reader` accepts, as JSON Schema (2020-12, as OpenAPI 3.1 reads it); `{}` (any
    value) for a reader that declares nothing."""
    if isinstance(reader, (Struct, Tagged)):
        return reader.json_schema()
    schema = _SCHEMAS.get(reader)
    return {} if schema is None else schema()


def any_of(*readers: Reader) -> Schema:
    """The schema of a value that one of `readers` reads (a hand-written reader's branches)."""
    return {"anyOf": [json_schema(reader) for reader in readers]}


class BodyError(ValueError):
    """A body that does not fit the dialect's request shape."""


def load_body(body: bytes | str | dict | list) -> JsonValue:
    """The body as a JSON value; raises ValueError with the reference's message."""
    if isinstance(body, (str, bytes, bytearray)):
        try:
            return parse_json_text(body)
        except ValueError as error:
            raise ValueError(f"invalid JSON request: {error}") from None
    return _python_to_json(body, 0, set())


def _python_to_json(value: object, depth: int, open_ids: set[int]) -> JsonValue:
    """A Python object as the reference's binding converts it (its errors included)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise OverflowError("integer is outside the JSON number range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            spelled = "NaN" if math.isnan(value) else str(value)
            raise ValueError(f"{spelled} is not a finite JSON number")
        return value
    if isinstance(value, str):
        # Lone surrogates fail here with the UnicodeEncodeError the binding raises.
        value.encode("utf-8")
        return value
    if isinstance(value, (dict, list, tuple)):
        if id(value) in open_ids:
            raise ValueError("circular reference in JSON input")
        depth += 1
        # The body itself is one of the MAX_NESTING levels (spec/recipe.md §15.12).
        if depth > MAX_NESTING:
            raise RecursionError(f"JSON input exceeds the maximum nesting depth of {MAX_NESTING}")
        open_ids.add(id(value))
        try:
            if isinstance(value, dict):
                out = {}
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise TypeError("JSON object keys must be str")
                    key.encode("utf-8")
                    out[key] = _python_to_json(item, depth, open_ids)
                return out
            return [_python_to_json(item, depth, open_ids) for item in value]
        finally:
            open_ids.discard(id(value))
    raise TypeError(f"{type(value).__name__} is not a JSON value")


# -- describing values in errors (serde_json's `JsonUnexpected`)
def describe(value: JsonValue) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{format_f64(value)}`"
    if isinstance(value, str):
        return f"string {rust_debug_str(value)}"
    if isinstance(value, list):
        return "sequence"
    return "map"


def rust_debug_str(text: str) -> str:
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\r":
            out.append("\\r")
        elif char == "\t":
            out.append("\\t")
        elif char == "\0":
            out.append("\\0")
        elif unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") or (
            unicodedata.category(char) == "Zs" and char != " "
        ):
            out.append(f"\\u{{{ord(char):x}}}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def invalid_type(value: JsonValue, expected: str) -> BodyError:
    return BodyError(f"invalid type: {describe(value)}, expected {expected}")


def unknown_variant(name: str, variants: tuple[str, ...]) -> BodyError:
    if not variants:
        return BodyError(f"unknown variant `{name}`, there are no variants")
    if len(variants) == 1:
        return BodyError(f"unknown variant `{name}`, expected `{variants[0]}`")
    if len(variants) == 2:
        return BodyError(f"unknown variant `{name}`, expected `{variants[0]}` or `{variants[1]}`")
    listed = ", ".join(f"`{v}`" for v in variants)
    return BodyError(f"unknown variant `{name}`, expected one of {listed}")


# -- scalar readers
@accepts(lambda: {"type": "string"})
def string(value: JsonValue) -> str:
    if not isinstance(value, str):
        raise invalid_type(value, "a string")
    return value


@accepts(lambda: {"type": "boolean"})
def boolean(value: JsonValue) -> bool:
    if not isinstance(value, bool):
        raise invalid_type(value, "a boolean")
    return value


@accepts(dict)
def any_value(value: JsonValue) -> JsonValue:
    return value


def _unsigned(bits: int) -> Reader:
    name = f"u{bits}"
    limit = 2**bits

    def read(value: JsonValue) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_type(value, name)
        if not 0 <= value < limit:
            raise BodyError(f"invalid value: integer `{value}`, expected {name}")
        return value

    return accepts(lambda: {"type": "integer", "minimum": 0, "maximum": limit - 1})(read)


u8 = _unsigned(8)
u32 = _unsigned(32)
u64 = _unsigned(64)


def to_f32(value: float) -> float:
    """Round to the nearest 32-bit float and widen back (the reference stores f32)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


@accepts(lambda: {"type": "number"})
def f32(value: JsonValue) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid_type(value, "f32")
    return to_f32(float(value))


def in_field(key: str, reader: Reader) -> Reader:
    """A reader whose errors name the field (`field `x`: …`), as hand-written serde code does."""

    def read(value: JsonValue) -> Any:
        try:
            return reader(value)
        except BodyError as error:
            raise BodyError(f"field `{key}`: {error}") from None

    return accepts(lambda: json_schema(reader))(read)


def optional(reader: Reader) -> Reader:
    def read(value: JsonValue) -> Any:
        return None if value is None else reader(value)

    return accepts(lambda: _nullable(json_schema(reader)))(read)


def _nullable(schema: Schema) -> Schema:
    return schema if not schema else {"anyOf": [schema, {"type": "null"}]}


def sequence(reader: Reader) -> Reader:
    def read(value: JsonValue) -> list:
        if not isinstance(value, list):
            raise invalid_type(value, "a sequence")
        return [reader(item) for item in value]

    return accepts(lambda: {"type": "array", "items": json_schema(reader)})(read)


def variants(*names: str) -> Reader:
    """A unit-variant enum spelled as a string."""

    def read(value: JsonValue) -> str:
        if isinstance(value, dict):
            if len(value) != 1:
                raise BodyError("invalid value: map, expected map with a single key")
            (value,) = value
        if not isinstance(value, str):
            raise invalid_type(value, "string or map")
        if value not in names:
            raise unknown_variant(value, names)
        return value

    return accepts(lambda: {"type": "string", "enum": list(names)})(read)


class Struct:
    """A struct: known fields read in the body's key order, unknown keys ignored.

    `defaults` are fields serde fills in when a sequence runs out before them
    (`#[serde(default)]`). `extensions` are fields deepwell reads beyond the reference's
    struct; positional (sequence) reading follows the reference's fields only.
    """

    def __init__(
        self,
        name: str,
        fields: dict[str, Reader],
        required: tuple[str, ...] = (),
        *,
        defaults: tuple[str, ...] = (),
        extensions: dict[str, Reader] | None = None,
    ) -> None:
        self.name = name
        self.fields = fields
        self.required = required
        self.defaults = defaults
        self.extensions = extensions or {}

    def __call__(self, value: JsonValue) -> dict[str, Any]:
        if isinstance(value, list):
            return self._from_sequence(value)
        if not isinstance(value, dict):
            raise invalid_type(value, f"struct {self.name}")
        out: dict[str, Any] = dict.fromkeys([*self.fields, *self.extensions])
        for key, item in value.items():
            reader = self.fields.get(key) or self.extensions.get(key)
            if reader is not None:
                out[key] = reader(item)
        for key in self.required:
            if key not in value:
                raise BodyError(f"missing field `{key}`")
        return out

    def json_schema(self) -> Schema:
        """The object form (the positional one is serde's quirk, not an API to describe)."""
        readers = {**self.fields, **self.extensions}
        schema: Schema = {
            "title": self.name,
            "type": "object",
            "properties": {key: json_schema(reader) for key, reader in readers.items()},
        }
        if self.required:
            schema["required"] = list(self.required)
        return schema

    def _from_sequence(self, items: list, variant: str | None = None) -> dict[str, Any]:
        """serde fills struct fields positionally from a sequence; `variant` names the enum
        variant (`Enum::Variant`) when the struct is one, which changes the error texts."""
        count = len(self.fields)
        plural = "" if count == 1 else "s"
        name = self.name if variant is None else f"variant {variant}"
        expected = f"struct {name} with {count} element{plural}"
        out: dict[str, Any] = dict.fromkeys([*self.fields, *self.extensions])
        for index, (key, reader) in enumerate(self.fields.items()):
            if index >= len(items):
                if key in self.defaults:
                    continue
                raise BodyError(f"invalid length {index}, expected {expected}")
            out[key] = reader(items[index])
        if len(items) > count:
            # Inside a tagged enum serde reads buffered content, which counts what it wanted.
            if variant is not None or _buffered[0]:
                raise BodyError(
                    f"invalid length {len(items)}, expected {count} element{plural} in sequence"
                )
            raise BodyError(f"invalid length {len(items)}, expected fewer elements in array")
        return out


# How many tagged enums are being read around the current value: serde reads their content
# from a buffer, and its sequence errors are worded differently there.
_buffered = [0]


def read_buffered(reader: Reader, value: JsonValue) -> Any:
    """`reader(value)` as the content of a tagged enum (for enums read by hand)."""
    _buffered[0] += 1
    try:
        return reader(value)
    finally:
        _buffered[0] -= 1


class Tagged:
    """An enum whose variant is named by a field of the object (`type`, `role`)."""

    def __init__(
        self,
        name: str,
        tag: str,
        readers: dict[str, Reader],
        *,
        other: Reader | None = None,
        indexed: bool = False,
        newtypes: tuple[str, ...] = (),
    ) -> None:
        """`other` reads variants not listed (serde's `#[serde(other)]`); else they fail.

        `indexed`: the tag may also be a variant's index (a non-negative integer), as some of
        the reference's enums accept. `newtypes`: variants that wrap a named struct, which
        names itself in errors; struct variants are named `Enum::Variant`. From a sequence,
        either reads the elements after the tag.
        """
        self.name = name
        self.tag = tag
        self.readers = readers
        self.other = other
        self.indexed = indexed
        self.newtypes = newtypes

    def json_schema(self) -> Schema:
        """One object schema per variant, its tag a constant; `other` adds any other tag."""
        variants = [self._variant_schema(tag, reader) for tag, reader in self.readers.items()]
        if self.other is not None:
            variants.append(self._variant_schema(None, self.other))
        return {"title": self.name, "anyOf": variants}

    def _variant_schema(self, tag: str | None, reader: Reader) -> Schema:
        tag_schema = {"type": "string"} if tag is None else {"const": tag}
        schema = json_schema(reader)
        if schema.get("type") == "object":
            properties = {self.tag: tag_schema, **schema.get("properties", {})}
            required = [self.tag, *schema.get("required", [])]
            return {**schema, "properties": properties, "required": required}
        tagged = {"type": "object", "properties": {self.tag: tag_schema}, "required": [self.tag]}
        return {"allOf": [tagged, schema]} if schema else tagged

    def __call__(self, value: JsonValue) -> tuple[str, Any]:
        if isinstance(value, list):
            # serde reads the tag from the first element of a sequence.
            if not value:
                raise BodyError(f"missing field `{self.tag}`")
            tag, rest = value[0], value[1:]
        elif isinstance(value, dict):
            if self.tag not in value:
                raise BodyError(f"missing field `{self.tag}`")
            tag = value[self.tag]
            rest = {k: v for k, v in value.items() if k != self.tag}
        else:
            raise invalid_type(value, f"internally tagged enum {self.name}")
        if self.indexed and isinstance(tag, int) and not isinstance(tag, bool) and tag >= 0:
            if tag >= len(self.readers):
                raise BodyError(
                    f"invalid value: integer `{tag}`, expected variant index "
                    f"0 <= i < {len(self.readers)}"
                )
            tag = list(self.readers)[tag]
        if not isinstance(tag, str):
            raise invalid_type(tag, "variant identifier")
        reader = self.readers.get(tag, self.other)
        if reader is None:
            raise unknown_variant(tag, tuple(self.readers))
        _buffered[0] += 1
        try:
            if isinstance(value, list) and isinstance(reader, Struct):
                if tag in self.newtypes:
                    return tag, reader._from_sequence(rest)
                variant = "".join(part.capitalize() for part in tag.split("_"))
                return tag, reader._from_sequence(rest, f"{self.name}::{variant}")
            return tag, reader(rest)
        finally:
            _buffered[0] -= 1
