"""The stage machine that splits model output into reasoning, content and DSML tool calls.

Follows spec/recipe.md §8.3; emits classified spans (actions), never whole values.
"""

from __future__ import annotations

from functools import lru_cache

from deepwell.recipe.options import ParsingOptions, ThinkingInitialStage
from deepwell.recipe.stream.matcher import Matcher, Pattern, PatternSet

# Action kinds. Runs (kind <= MATCHED) are spans of input: the stage's default action, or
# the text a pattern consumed (MATCHED); the rest are single atoms a completed pattern made.
CONTENT = 0
REASONING = 1
TO_SPACE = 2
KEY = 3
STRING_VALUE = 4
RAW_VALUE = 5
DROP = 6
MATCHED = 7
BRACKET = 8
ARGUMENT = 9
CALL = 10
STOP = 11

# Stages (spec/recipe.md §8.3 table).
ANSWER = 0
JSON = 1
AFTER_JSON = 2
REASONING_STAGE = 3
TOOL_CALLS = 4
TOOL_NAME = 5
ARGS = 6
PARAM_NAME = 7
PARAM_TYPE = 8
VALUE = 9
FINISHED = 10

# What a completed pattern does besides dropping its text.
_NOTHING = 0
_BRACKET = 1
_STOP = 2
_CALL = 3
_OPEN_PARAM = 4
_CLOSE_CALL = 5
_COLON = 6
_STRING_OPEN = 7
_RAW_OPEN = 8
_VALUE_CLOSE = 9
_LEADING = 10

# Next stage's leading-newline flag, where a stage has one.
_KEEP_LEADING = 1
_NO_LEADING = 0

Action = tuple[int, int, int, str]


class _Stage:
    __slots__ = ("pattern_set", "outcomes", "leading_at")

    def __init__(self, rules: list[tuple[Pattern | None, int, int, int]]) -> None:
        # A None pattern marks where the leading-newline rule sits in the priority order.
        self.leading_at = next((i for i, r in enumerate(rules) if r[0] is None), len(rules))
        real = [r for r in rules if r[0] is not None]
        self.pattern_set = PatternSet([r[0] for r in real])
        self.outcomes = [(r[1], r[2], r[3]) for r in real]


def build_stages(options: ParsingOptions, think_end: str, dsml: str) -> list[_Stage]:
    """The stage table; `think_end` and `dsml` are the marker spellings to match."""
    return _stage_table(
        options.parse_tool_calls,
        options.parse_json_output,
        tuple(options.stop_sequences),
        think_end,
        dsml,
    )


# Tables are immutable (match state lives in Matcher), so requests with the same settings
# share one instead of compiling ~20 patterns each.
@lru_cache(maxsize=256)
def _stage_table(
    tools: bool, json_output: bool, stop_sequences: tuple[str, ...], think_end: str, dsml: str
) -> list[_Stage]:
    stops = [Pattern(s) for s in stop_sequences if s]
    open_calls = [(Pattern("<" + dsml, newlines=True), TOOL_CALLS, _NOTHING, 0)] if tools else []
    stop_rules = [(p, FINISHED, _STOP, 0) for p in stops]
    if json_output:
        answer_head = [
            (Pattern("```json\n"), JSON, _NOTHING, 0),
            (Pattern("```\n"), JSON, _NOTHING, 0),
            (Pattern("{"), JSON, _BRACKET, 0),
            (Pattern("["), JSON, _BRACKET, 0),
        ]
    else:
        answer_head = stop_rules
    close_dsml = Pattern("</" + dsml)
    stages = [None] * 11
    stages[ANSWER] = _Stage(
        answer_head
        + open_calls
        + [(None, ANSWER, _LEADING, _KEEP_LEADING)]
        + [(Pattern(think_end), ANSWER, _NOTHING, _NO_LEADING)]
    )
    stages[JSON] = _Stage(stop_rules + [(Pattern("\n```"), AFTER_JSON, _NOTHING, 0)])
    stages[AFTER_JSON] = _Stage(open_calls)
    stages[REASONING_STAGE] = _Stage(
        open_calls
        + [(None, REASONING_STAGE, _LEADING, _KEEP_LEADING)]
        + [(Pattern(think_end, newlines=True), ANSWER, _NOTHING, _KEEP_LEADING)]
    )
    stages[TOOL_CALLS] = _Stage(
        [
            (Pattern('invoke name="'), TOOL_NAME, _NOTHING, 0),
            (Pattern("</" + dsml + "tool_calls>"), FINISHED, _NOTHING, 0),
            (Pattern("</" + dsml + " calls>"), FINISHED, _NOTHING, 0),
        ]
    )
    stages[TOOL_NAME] = _Stage([(Pattern('"'), ARGS, _CALL, 0)])
    stages[ARGS] = _Stage(
        [
            (Pattern("parameter name="), PARAM_NAME, _OPEN_PARAM, 0),
            (close_dsml, TOOL_CALLS, _CLOSE_CALL, 0),
        ]
    )
    # spec/recipe.md §15.7: a parameter key ends at the first space, quotes included.
    stages[PARAM_NAME] = _Stage([(Pattern(" "), PARAM_TYPE, _COLON, 0)])
    stages[PARAM_TYPE] = _Stage(
        [
            (Pattern('true">'), VALUE, _STRING_OPEN, 0),
            (Pattern('false">'), VALUE, _RAW_OPEN, 0),
        ]
    )
    stages[VALUE] = _Stage([(close_dsml, ARGS, _VALUE_CLOSE, 0)])
    stages[FINISHED] = _Stage([])
    return stages


class StreamParser:
    """Classifies a character stream; positions are absolute offsets since the stream began.

    `feed` appends actions `(kind, start, end, text)` to `out`: runs carry their text, a
    CALL carries the tool name, a STOP the stop sequence, ARGUMENT/BRACKET their text.
    Characters that may still begin a marker stay pending (`pending_start`) until resolved.
    """

    __slots__ = (
        "_stages",
        "_stage_id",
        "_stage",
        "_matcher",
        "_fresh",
        "_default",
        "_buf",
        "_buf_start",
        "_json",
        "_name",
        "_first_arg",
        "_string_value",
        "end",
    )

    def __init__(self, options: ParsingOptions, stages: list[_Stage]) -> None:
        self._stages = stages
        self._json = options.parse_json_output
        self._buf = ""
        self._buf_start = 0
        self._name = ""
        self._first_arg = True
        self._string_value = True
        self.end = 0
        stage = options.thinking_initial_stage
        if options.starts_in_tool_calls:
            self._enter(TOOL_CALLS, False)
        elif stage is None:
            self._enter(ANSWER, True)
        elif stage.starts_in_reasoning():
            self._enter(REASONING_STAGE, stage is ThinkingInitialStage.ReasoningStart)
        else:
            self._enter(ANSWER, False)

    @property
    def pending_start(self) -> int:
        return self._buf_start if self._buf else self.end

    def _enter(self, stage_id: int, leading: bool) -> None:
        self._stage_id = stage_id
        self._stage = self._stages[stage_id]
        self._matcher = Matcher(self._stage.pattern_set)
        self._fresh = leading
        if stage_id == ANSWER:
            self._default = TO_SPACE if self._json else CONTENT
        elif stage_id == JSON:
            self._default = CONTENT
        elif stage_id == AFTER_JSON:
            self._default = TO_SPACE
        elif stage_id == REASONING_STAGE:
            self._default = REASONING
        elif stage_id == PARAM_NAME:
            self._default = KEY
        elif stage_id == VALUE:
            self._default = STRING_VALUE if self._string_value else RAW_VALUE
        else:
            self._default = DROP

    def use_stages(self, stages: list[_Stage], out: list[Action]) -> None:
        """Switch marker spellings (text ↔ token symbols); pending text is matched again."""
        if stages is self._stages:
            return
        self._stages = stages
        self._stage = stages[self._stage_id]
        self._matcher = Matcher(self._stage.pattern_set)
        pending, start = self._buf, self._buf_start
        self._buf = ""
        for k, c in enumerate(pending):
            self._step(c, start + k, out)

    def feed(self, text: str, out: list[Action]) -> None:
        pos = self.end
        n = len(text)
        self.end = pos + n
        i = 0
        while i < n:
            if not self._buf and not self._fresh:
                if self._stage_id == FINISHED:
                    out.append((DROP, pos + i, pos + n, text[i:]))
                    return
                m = self._stage.pattern_set.trigger.search(text, i)
                j = m.start() if m else n
                if j > i:
                    self._run(text[i:j], pos + i, pos + j, out)
                    i = j
                    if i == n:
                        return
            self._step(text[i], pos + i, out)
            i += 1

    def settle(self, text: str) -> int:
        """Take a non-empty `text` whole if no character of it can begin a marker.

        Returns the kind of the run it makes, or -1 (nothing consumed) when `text` needs the
        character-level path: a marker may start in it, text is pending, or a stage start.
        """
        if (
            not text
            or self._buf
            or self._fresh
            or self._stage_id == TOOL_NAME
            or self._stage.pattern_set.trigger.search(text)
        ):
            return -1
        self.end += len(text)
        return self._default

    def flush(self, out: list[Action]) -> None:
        """End of input: whatever is still pending gets the stage's default action."""
        if self._buf:
            self._run(self._buf, self._buf_start, self._buf_start + len(self._buf), out)
            self._buf = ""

    def _run(self, text: str, start: int, end: int, out: list[Action]) -> None:
        if self._stage_id == TOOL_NAME:
            self._name += text
        out.append((self._default, start, end, text))

    def _step(self, c: str, p: int, out: list[Action]) -> None:
        buf = self._buf + c
        buf_start = self._buf_start if self._buf else p
        index, length = self._matcher.step(c)
        if self._fresh:
            self._fresh = False
            if c == "\n" and not (0 <= index < self._stage.leading_at):
                # The stage's very first character is a newline: drop it and start over.
                out.append((DROP, p, p + 1, c))
                self._enter(self._stage_id, True)
                return
        if index < 0:
            settled = len(buf) - length
            if settled:
                self._run(buf[:settled], buf_start, buf_start + settled, out)
            self._buf = buf[settled:]
            self._buf_start = buf_start + settled
            return
        match_start = p + 1 - length
        if match_start > buf_start:
            self._run(buf[: match_start - buf_start], buf_start, match_start, out)
        self._buf = ""
        self._match(index, buf[match_start - buf_start :], match_start, p + 1, out)

    def _match(self, index: int, text: str, start: int, end: int, out: list[Action]) -> None:
        out.append((MATCHED, start, end, text))
        next_stage, action, leading = self._stage.outcomes[index]
        if action == _BRACKET:
            out.append((BRACKET, start, end, text))
        elif action == _STOP:
            out.append((STOP, start, end, self._stage.pattern_set.patterns[index].text))
        elif action == _CALL:
            out.append((CALL, start, end, self._name))
            self._name = ""
            self._first_arg = True
        elif action == _OPEN_PARAM:
            out.append((ARGUMENT, start, end, "{" if self._first_arg else ", "))
            self._first_arg = False
        elif action == _CLOSE_CALL:
            out.append((ARGUMENT, start, end, "{}" if self._first_arg else "}"))
        elif action == _COLON:
            out.append((ARGUMENT, start, end, ": "))
        elif action == _STRING_OPEN:
            out.append((ARGUMENT, start, end, '"'))
            self._string_value = True
        elif action == _RAW_OPEN:
            self._string_value = False
        elif action == _VALUE_CLOSE and self._string_value:
            out.append((ARGUMENT, start, end, '"'))
        self._enter(next_stage, leading == _KEEP_LEADING)
