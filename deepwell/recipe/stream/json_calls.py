"""Tool calls written as JSON objects: Hermes `<tool_call>{…}</tool_call>` and Llama-3 JSON.

A drop-in for parser.py's StreamParser (same actions), so the processor and every dialect
stream these calls exactly as DSML ones: a CALL when the name is known, then arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from deepwell.recipe.options import ParsingOptions
from deepwell.recipe.stream.matcher import Matcher, Pattern, PatternSet
from deepwell.recipe.stream.parser import (
    ARGUMENT,
    CALL,
    CONTENT,
    DROP,
    MATCHED,
    RAW_VALUE,
    STOP,
    Action,
)

DSML = "dsml"
HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
TOOL_CALL_FORMATS = (DSML, HERMES, LLAMA3_JSON)

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# Keys that name the call, and that hold its arguments (Llama 3.1 writes `parameters`).
_NAME_KEY = "name"
_ARGUMENT_KEYS = ("arguments", "parameters")

# Parser states.
_TEXT = 0
_START = 1
_OBJECT = 2
_AFTER_OBJECT = 3
_FINISHED = 4

# Where the scanner is inside the call object, at depth 1.
_KEY_WAIT = 0
_KEY = 1
_COLON_WAIT = 2
_VALUE_WAIT = 3
_VALUE = 4
_COMMA_WAIT = 5


@dataclass(frozen=True)
class JsonCallMarkers:
    """One format's marker spellings as the parser must match them (text or token symbols)."""

    format: str
    open: str
    close: str
    stops: tuple[str, ...]


def json_call_markers(options: ParsingOptions, spell: Callable[[str], str]) -> JsonCallMarkers:
    """The markers of `options.tool_call_format`; `spell` maps a spelling to the chunk mode's."""
    if options.tool_call_format == HERMES:
        return JsonCallMarkers(
            HERMES, spell(HERMES_OPEN), spell(HERMES_CLOSE), tuple(options.stop_sequences)
        )
    return JsonCallMarkers(LLAMA3_JSON, spell(PYTHON_TAG), "", tuple(options.stop_sequences))


class JsonCallParser:
    """Classifies model output into content and JSON tool calls; positions are absolute.

    Hermes calls may appear anywhere in the answer, each in `<tool_call>`…`</tool_call>`;
    Llama-3 calls only when the answer starts with `{` or `<|python_tag|>`, `;`-separated.
    Everything of a call object stays pending until its name is read, so an object that turns
    out to be no call (no name, broken JSON) is released as the content it was.
    """

    __slots__ = (
        "_tools",
        "_markers",
        "_text_set",
        "_close_set",
        "_matcher",
        "_state",
        "_after_call",
        "_buf",
        "_buf_start",
        "_depth",
        "_slot",
        "_key",
        "_value_key",
        "_nest",
        "_in_string",
        "_escape",
        "_name_raw",
        "_args",
        "_args_seen",
        "_called",
        "end",
    )

    def __init__(self, options: ParsingOptions, markers: JsonCallMarkers) -> None:
        self._tools = options.parse_tool_calls
        self._buf = ""
        self._buf_start = 0
        self._after_call = False
        self.end = 0
        self._set_markers(markers)
        self._matcher = Matcher(self._text_set)
        self._state = _START if self._tools and markers.format == LLAMA3_JSON else _TEXT
        self._reset_object()

    @property
    def pending_start(self) -> int:
        return self._buf_start if self._buf else self.end

    def _set_markers(self, markers: JsonCallMarkers) -> None:
        self._markers = markers
        patterns = [Pattern(s) for s in markers.stops if s]
        if self._tools and markers.format == HERMES:
            patterns.append(Pattern(markers.open, newlines=True))
        self._text_set = PatternSet(patterns)
        self._close_set = PatternSet([Pattern(markers.close)] if markers.close else [])

    def _reset_object(self) -> None:
        self._depth = 0
        self._slot = _KEY_WAIT
        self._key = ""
        self._value_key = ""
        self._nest = 0
        self._in_string = False
        self._escape = False
        self._name_raw = ""
        self._args = ""
        self._args_seen = False
        self._called = False

    def use_stages(self, markers: JsonCallMarkers, out: list[Action]) -> None:
        """Switch marker spellings (text ↔ token symbols); pending text is matched again."""
        if markers == self._markers:
            return
        self._set_markers(markers)
        if self._state == _OBJECT:
            return
        self._matcher = Matcher(self._close_set if self._state == _AFTER_OBJECT else self._text_set)
        pending, start = self._buf, self._buf_start
        self._buf = ""
        for k, c in enumerate(pending):
            self._step(c, start + k, out)

    def settle(self, text: str) -> int:
        """Take `text` whole if it is plain content (see StreamParser.settle); else -1."""
        if (
            not text
            or self._state != _TEXT
            or self._buf
            or self._after_call
            or self._text_set.trigger.search(text)
        ):
            return -1
        self.end += len(text)
        return CONTENT

    def feed(self, text: str, out: list[Action]) -> None:
        pos = self.end
        n = len(text)
        self.end = pos + n
        i = 0
        while i < n:
            if self._state == _FINISHED:
                out.append((DROP, pos + i, pos + n, text[i:]))
                return
            if self._state == _TEXT and not self._buf and not self._after_call:
                m = self._text_set.trigger.search(text, i)
                j = m.start() if m else n
                if j > i:
                    out.append((CONTENT, pos + i, pos + j, text[i:j]))
                    i = j
                    if i == n:
                        return
            self._step(text[i], pos + i, out)
            i += 1

    def flush(self, out: list[Action]) -> None:
        """End of input: a call never named is content; pending text takes its default."""
        if not self._buf:
            return
        text, start = self._buf, self._buf_start
        self._buf = ""
        if self._state == _OBJECT and self._called:
            out.append((DROP, start, start + len(text), text))
        else:
            self._content(text, start, out)

    # --- states ---

    def _step(self, c: str, p: int, out: list[Action]) -> None:
        state = self._state
        if state == _TEXT:
            self._text_step(c, p, out)
        elif state == _START:
            self._start_step(c, p, out)
        elif state == _OBJECT:
            self._object_step(c, p, out)
        elif state == _AFTER_OBJECT:
            self._after_object_step(c, p, out)
        else:
            out.append((DROP, p, p + 1, c))

    def _content(self, text: str, start: int, out: list[Action]) -> None:
        if self._after_call:
            # Whitespace between and after calls is layout, not an answer.
            body = text.lstrip()
            cut = len(text) - len(body)
            if cut:
                out.append((DROP, start, start + cut, text[:cut]))
            if not body:
                return
            self._after_call = False
            text, start = body, start + cut
        out.append((CONTENT, start, start + len(text), text))

    def _text_step(self, c: str, p: int, out: list[Action]) -> None:
        buf = self._buf + c
        buf_start = self._buf_start if self._buf else p
        index, length = self._matcher.step(c)
        if index < 0:
            settled = len(buf) - length
            if settled:
                self._content(buf[:settled], buf_start, out)
            self._buf = buf[settled:]
            self._buf_start = buf_start + settled
            return
        match_start = p + 1 - length
        if match_start > buf_start:
            self._content(buf[: match_start - buf_start], buf_start, out)
        matched = buf[match_start - buf_start :]
        self._buf = ""
        pattern = self._text_set.patterns[index]
        if pattern.newlines:
            # The opening tag: the call stays pending until its name is read.
            self._begin_object(matched, match_start)
            return
        out.append((MATCHED, match_start, p + 1, matched))
        out.append((STOP, match_start, p + 1, pattern.text))
        self._state = _FINISHED

    def _start_step(self, c: str, p: int, out: list[Action]) -> None:
        """Llama-3 JSON: the answer is a call only if it opens with `{` or the python tag."""
        buf = self._buf + c
        start = self._buf_start if self._buf else p
        head = buf.lstrip()
        if head == "{":
            self._begin_object(buf[:-1], start)
            self._object_step(c, p, out)
        elif head == self._markers.open:
            self._begin_object(buf, start)
        elif head == "" or self._markers.open.startswith(head):
            self._buf, self._buf_start = buf, start
        else:
            self._state = _TEXT
            self._matcher = Matcher(self._text_set)
            self._buf = ""
            for k, ch in enumerate(buf):
                self._text_step(ch, start + k, out)

    def _begin_object(self, pending: str, start: int) -> None:
        self._state = _OBJECT
        self._reset_object()
        self._buf, self._buf_start = pending, start

    def _after_object_step(self, c: str, p: int, out: list[Action]) -> None:
        if self._markers.format == LLAMA3_JSON:
            if c.isspace() or c == ";":
                out.append((DROP, p, p + 1, c))
                if c == ";":
                    self._begin_object("", p + 1)
                return
            self._to_text(c, p, out)
            return
        index, length = self._matcher.step(c)
        if index >= 0 or length or c.isspace():
            out.append((DROP, p, p + 1, c))
            if index >= 0:
                self._state = _TEXT
                self._matcher = Matcher(self._text_set)
            return
        # No closing tag: what follows the call is the answer again.
        self._to_text(c, p, out)

    def _to_text(self, c: str, p: int, out: list[Action]) -> None:
        self._state = _TEXT
        self._matcher = Matcher(self._text_set)
        self._text_step(c, p, out)

    # --- the call object ---

    def _object_step(self, c: str, p: int, out: list[Action]) -> None:
        # A value that does not take `c` was a scalar ended by it: `c` is structure.
        if self._slot == _VALUE and self._value_step(c, p, out):
            return
        if not self._structure_step(c, p, out):
            self._abandon(c, p, out)

    def _keep(self, c: str, p: int, out: list[Action], kind: int = DROP) -> None:
        """One character of the call object: pending until the call is named."""
        if not self._called:
            if not self._buf:
                self._buf_start = p
            self._buf += c
        elif kind == RAW_VALUE:
            out.append((RAW_VALUE, p, p + 1, c))
        else:
            out.append((DROP, p, p + 1, c))

    def _structure_step(self, c: str, p: int, out: list[Action]) -> bool:
        """Depth 0 and 1 outside values; False when `c` cannot be there."""
        slot = self._slot
        if self._depth == 0:
            if c == "{":
                self._depth = 1
                self._slot = _KEY_WAIT
            elif not c.isspace():
                return False
        elif slot == _KEY:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._slot = _COLON_WAIT
                self._keep(c, p, out)
                return True
            self._key += c
        elif slot in (_KEY_WAIT, _COMMA_WAIT) and c == "}":
            self._keep(c, p, out)
            self._close_object(p, out)
            return True
        elif slot == _KEY_WAIT and c == '"':
            self._slot = _KEY
            self._key = ""
        elif slot == _COMMA_WAIT and c == ",":
            self._slot = _KEY_WAIT
        elif slot == _COLON_WAIT and c == ":":
            self._slot = _VALUE_WAIT
        elif slot == _VALUE_WAIT and not c.isspace():
            self._slot = _VALUE
            self._value_key = self._key
            self._in_string = c == '"'
            self._nest = 1 if c in "{[" else 0
            if self._value_key in _ARGUMENT_KEYS:
                self._args_seen = True
            self._value_char(c, p, out)
            return True
        elif not c.isspace():
            return False
        self._keep(c, p, out)
        return True

    def _value_step(self, c: str, p: int, out: list[Action]) -> bool:
        """A character inside a value at depth 1; False when it ends a scalar instead."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._nest == 0:
                    self._value_char(c, p, out)
                    self._end_value(p, out)
                    return True
        elif c in "{[":
            self._nest += 1
        elif c in "}]":
            if self._nest == 0:
                self._slot = _COMMA_WAIT
                return False
            self._nest -= 1
            if self._nest == 0:
                self._value_char(c, p, out)
                self._end_value(p, out)
                return True
        elif c == '"':
            self._in_string = True
        elif self._nest == 0 and (c == "," or c.isspace()):
            self._slot = _COMMA_WAIT
            return False
        self._value_char(c, p, out)
        return True

    def _value_char(self, c: str, p: int, out: list[Action]) -> None:
        key = self._value_key
        if key == _NAME_KEY and not self._called:
            self._name_raw += c
            self._keep(c, p, out)
        elif key in _ARGUMENT_KEYS:
            if self._called:
                out.append((RAW_VALUE, p, p + 1, c))
            else:
                self._args += c
                self._keep(c, p, out)
        else:
            self._keep(c, p, out)

    def _end_value(self, p: int, out: list[Action]) -> None:
        self._slot = _COMMA_WAIT
        if self._value_key != _NAME_KEY or self._called:
            return
        try:
            name = json.loads(self._name_raw)
        except ValueError:
            name = None
        if not isinstance(name, str):
            return
        # Named: the call is real. Release what was held, then stream the rest.
        text, start = self._buf, self._buf_start
        self._buf = ""
        out.append((DROP, start, p + 1, text))
        out.append((CALL, p, p + 1, name))
        self._called = True
        if self._args:
            out.append((ARGUMENT, p, p + 1, self._args))

    def _close_object(self, p: int, out: list[Action]) -> None:
        if not self._called:
            self._release_as_content(out)
            return
        if not self._args_seen:
            out.append((ARGUMENT, p, p + 1, "{}"))
        self._state = _AFTER_OBJECT
        self._matcher = Matcher(self._close_set)
        self._after_call = True
        self._reset_object()

    def _abandon(self, c: str, p: int, out: list[Action]) -> None:
        """`c` breaks the call object: an unnamed one was content; a named one is over."""
        if self._called:
            out.append((DROP, p, p + 1, c))
            self._close_object(p, out)
            return
        self._keep(c, p, out)
        self._release_as_content(out)

    def _release_as_content(self, out: list[Action]) -> None:
        text, start = self._buf, self._buf_start
        self._buf = ""
        self._state = _TEXT
        self._matcher = Matcher(self._text_set)
        self._reset_object()
        if text:
            self._content(text, start, out)
