"""Request body text → JSON value, failing exactly where and how the reference's parser fails.

The reference parses with serde_json; a syntax error names a cause and a byte position (§1).
"""

from __future__ import annotations

import json
import math

from deepwell.recipe.json_value import TEXT_MAX_NESTING, JsonValue, is_serde_value, json_int

_WHITESPACE = b" \n\t\r"
_ESCAPES = {
    ord('"'): '"',
    ord("\\"): "\\",
    ord("/"): "/",
    ord("b"): "\b",
    ord("f"): "\f",
    ord("n"): "\n",
    ord("r"): "\r",
    ord("t"): "\t",
}


class JsonSyntaxError(ValueError):
    """A body that is not JSON text; the message is serde_json's, with its line and column."""


def parse_json_text(text: str | bytes) -> JsonValue:
    """Parse a body the way serde_json does: integers beyond 64 bits become floats."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    try:
        value = json.loads(
            data.decode("utf-8"),
            parse_int=json_int,
            parse_constant=_reject,
            object_pairs_hook=_object,
        )
    except (ValueError, RecursionError):
        value = None
    else:
        if is_serde_value(value):
            return value
    # Python's parser is lenient where serde_json is not (NaN, lone surrogates, depth, the
    # values a repeated key drops) and reports other positions; the exact parser below runs
    # only for texts that failed or repeat a key.
    return _Parser(data).parse()


def _reject(name: str) -> None:
    raise ValueError(name)


class _DuplicateKey(ValueError):
    """An object repeats a key: the value it drops is never seen by `is_serde_value`."""


def _object(pairs: list[tuple[str, JsonValue]]) -> dict:
    # serde_json keeps the last value of a repeated key but reads (and may refuse) every
    # one: `{"a": 1e400, "a": 1}` is "number out of range". The exact parser decides.
    result = dict(pairs)
    if len(result) != len(pairs):
        raise _DuplicateKey
    return result


class _Parser:
    """serde_json's `from_slice` into a `Value`, reproduced for its error messages."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.index = 0
        # serde_json gives up when a container would be one more than it allows open.
        self.remaining_depth = TEXT_MAX_NESTING + 1

    def parse(self) -> JsonValue:
        value = self.value()
        byte = self.skip_whitespace()
        if byte is not None:
            raise self.peek_error("trailing characters")
        return value

    # -- positions: `error` points at the next unread byte, `peek_error` one past it
    def error(self, reason: str) -> JsonSyntaxError:
        return self._at(self.index, reason)

    def peek_error(self, reason: str) -> JsonSyntaxError:
        return self._at(min(len(self.data), self.index + 1), reason)

    def _at(self, index: int, reason: str) -> JsonSyntaxError:
        before = self.data[:index]
        line = before.count(b"\n") + 1
        column = index - (before.rfind(b"\n") + 1)
        return JsonSyntaxError(f"{reason} at line {line} column {column}")

    def peek(self) -> int | None:
        return self.data[self.index] if self.index < len(self.data) else None

    def skip_whitespace(self) -> int | None:
        while self.index < len(self.data) and self.data[self.index] in _WHITESPACE:
            self.index += 1
        return self.peek()

    def value(self) -> JsonValue:
        byte = self.skip_whitespace()
        if byte is None:
            raise self.peek_error("EOF while parsing a value")
        if byte == ord("n"):
            self.index += 1
            self.ident(b"ull")
            return None
        if byte == ord("t"):
            self.index += 1
            self.ident(b"rue")
            return True
        if byte == ord("f"):
            self.index += 1
            self.ident(b"alse")
            return False
        if byte == ord("-"):
            self.index += 1
            return self.number(positive=False)
        if ord("0") <= byte <= ord("9"):
            return self.number(positive=True)
        if byte == ord('"'):
            self.index += 1
            return self.string()
        if byte in b"[{":
            self.remaining_depth -= 1
            if self.remaining_depth == 0:
                raise self.peek_error("recursion limit exceeded")
            self.index += 1
            result = self.array() if byte == ord("[") else self.object()
            self.remaining_depth += 1
            return result
        raise self.peek_error("expected value")

    def ident(self, rest: bytes) -> None:
        for expected in rest:
            byte = self.peek()
            if byte is None:
                raise self.error("EOF while parsing a value")
            self.index += 1
            if byte != expected:
                raise self.error("expected ident")

    def array(self) -> list:
        items: list = []
        while True:
            byte = self.skip_whitespace()
            if byte == ord("]"):
                self.index += 1
                return items
            if items:
                if byte is None:
                    raise self.peek_error("EOF while parsing a list")
                if byte != ord(","):
                    raise self.peek_error("expected `,` or `]`")
                self.index += 1
                byte = self.skip_whitespace()
                if byte == ord("]"):
                    raise self.peek_error("trailing comma")
            elif byte is None:
                raise self.peek_error("EOF while parsing a list")
            if byte is None:
                raise self.peek_error("EOF while parsing a value")
            items.append(self.value())

    def object(self) -> dict:
        result: dict = {}
        first = True
        while True:
            byte = self.skip_whitespace()
            if byte == ord("}"):
                self.index += 1
                return result
            if not first:
                if byte is None:
                    raise self.peek_error("EOF while parsing an object")
                if byte != ord(","):
                    raise self.peek_error("expected `,` or `}`")
                self.index += 1
                byte = self.skip_whitespace()
            elif byte is None:
                raise self.peek_error("EOF while parsing an object")
            first = False
            if byte == ord("}"):
                raise self.peek_error("trailing comma")
            if byte is None:
                raise self.peek_error("EOF while parsing a value")
            if byte != ord('"'):
                raise self.peek_error("key must be a string")
            self.index += 1
            key = self.string()
            byte = self.skip_whitespace()
            if byte is None:
                raise self.peek_error("EOF while parsing an object")
            if byte != ord(":"):
                raise self.peek_error("expected `:`")
            self.index += 1
            result[key] = self.value()

    def number(self, *, positive: bool) -> int | float:
        start = self.index - (0 if positive else 1)
        byte = self.peek()
        if byte is None:
            raise self.error("EOF while parsing a value")
        self.index += 1
        if byte == ord("0"):
            following = self.peek()
            if following is not None and ord("0") <= following <= ord("9"):
                raise self.peek_error("invalid number")
        elif not ord("1") <= byte <= ord("9"):
            raise self.error("invalid number")
        self.digits()
        is_float = False
        if self.peek() == ord("."):
            is_float = True
            self.index += 1
            if not self.digits():
                if self.peek() is None:
                    raise self.peek_error("EOF while parsing a value")
                raise self.peek_error("invalid number")
        if self.peek() in (ord("e"), ord("E")):
            is_float = True
            self.index += 1
            if self.peek() in (ord("+"), ord("-")):
                self.index += 1
            byte = self.peek()
            if byte is None:
                raise self.error("EOF while parsing a value")
            self.index += 1
            if not ord("0") <= byte <= ord("9"):
                raise self.error("invalid number")
            self.digits()
        text = self.data[start : self.index].decode("ascii")
        value = float(text) if is_float else json_int(text)
        if isinstance(value, float) and math.isinf(value):
            raise self.error("number out of range")
        return value

    def digits(self) -> bool:
        start = self.index
        while self.index < len(self.data) and 48 <= self.data[self.index] <= 57:
            self.index += 1
        return self.index > start

    def string(self) -> str:
        start = self.index
        raw = bytearray()
        while True:
            if self.index >= len(self.data):
                raise self.error("EOF while parsing a string")
            byte = self.data[self.index]
            if byte == ord('"'):
                raw += self.data[start : self.index]
                self.index += 1
                break
            if byte == ord("\\"):
                raw += self.data[start : self.index]
                self.index += 1
                raw += self.escape().encode("utf-8")
                start = self.index
            elif byte < 0x20:
                self.index += 1
                raise self.error("control character (\\u0000-\\u001F) found while parsing a string")
            else:
                self.index += 1
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error("invalid unicode code point") from None

    def escape(self) -> str:
        byte = self.peek()
        if byte is None:
            raise self.error("EOF while parsing a string")
        self.index += 1
        if byte in _ESCAPES:
            return _ESCAPES[byte]
        if byte != ord("u"):
            raise self.error("invalid escape")
        first = self.hex4()
        if 0xDC00 <= first <= 0xDFFF:
            raise self.error("lone leading surrogate in hex escape")
        if not 0xD800 <= first <= 0xDBFF:
            return chr(first)
        for expected in b"\\u":
            byte = self.peek()
            if byte is None:
                raise self.error("EOF while parsing a string")
            self.index += 1
            if byte != expected:
                raise self.error("unexpected end of hex escape")
        second = self.hex4()
        if not 0xDC00 <= second <= 0xDFFF:
            raise self.error("lone leading surrogate in hex escape")
        return chr(0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00))

    def hex4(self) -> int:
        if self.index + 4 > len(self.data):
            self.index = len(self.data)
            raise self.error("EOF while parsing a string")
        digits = self.data[self.index : self.index + 4]
        self.index += 4
        try:
            if not all(chr(d) in "0123456789abcdefABCDEF" for d in digits):
                raise ValueError
            return int(digits, 16)
        except ValueError:
            raise self.error("invalid escape") from None
