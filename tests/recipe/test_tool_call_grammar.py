"""The DSML tool-call grammar, compiled by llguidance against DeepSeek's tokenizer.

It must accept every call block the encoder itself renders (V4 and V4.1) and refuse the
malformed ones; `｜DSML｜` is the special token, everything else text (spec/recipe.md §4.3).
"""

from __future__ import annotations

import json

import llguidance
import pytest
from vector_cases import TOKENIZER_PATH, v4_tokenizer

from deepwell.recipe import (
    AssistantMessage,
    Conversation,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    ToolCall,
    ToolDefinition,
    UserMessage,
)
from deepwell.recipe.encoding.tool_call_grammar import DsmlTags, tool_call_grammar

DSML = "｜DSML｜"
EOS_ID = 1


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    schema = {"type": "object", "properties": properties, **extra}
    if required is not None:
        schema["required"] = required
    return schema


WEATHER = ToolDefinition(
    "get_weather",
    "Weather in a city",
    obj(
        {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Zürich"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "note": {"type": "string", "maxLength": 12},
        },
        ["city"],
    ),
)
PING = ToolDefinition("ping", None, None)
EMPTY = ToolDefinition("now", None, obj({}))
FLAGS = ToolDefinition(
    "set_flags",
    None,
    obj({"on": {"type": "boolean"}, "ids": {"type": "array", "items": {"type": "integer"}}}),
)
NESTED = ToolDefinition(
    "move",
    None,
    obj(
        {
            "to": {"$ref": "#/$defs/point"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        },
        ["to", "code"],
        **{"$defs": {"point": obj({"x": {"type": "number"}, "y": {"type": "number"}}, ["x", "y"])}},
    ),
)
TOOLS = [WEATHER, PING, EMPTY, FLAGS, NESTED]
ENCODINGS = {"v4": DeepseekV4Encoding, "v41": DeepseekV41Encoding}


@pytest.fixture(scope="module")
def grammar_tokenizer() -> llguidance.LLTokenizer:
    # The V4.1 file differs only in the spelling of id 128799, which no call block uses.
    return llguidance.LLTokenizer(TOKENIZER_PATH.read_text(), eos_token=EOS_ID)


@pytest.fixture(params=sorted(ENCODINGS))
def encoding(request):
    return ENCODINGS[request.param]().with_tokenizer(v4_tokenizer())


def rendered_block(encoding, calls: list[ToolCall], tools=TOOLS) -> str:
    """What follows the prompt's opening calls line when the encoder renders `calls`."""
    conversation = Conversation(
        [UserMessage("hi"), AssistantMessage("", tool_calls=calls)],
        thinking_mode=False,
        tools=tools,
    )
    text = encoding.render_conversation(conversation).prompt
    end = text.rindex("<｜end▁of▁sentence｜>")
    opening = f"<{DSML}{encoding.tag_names[0]}>\n"
    return text[text.rindex(opening, 0, end) + len(opening) : end]


def token_ids(text: str) -> list[int]:
    """`text` as a model would write it: DSML as its special token, the rest as plain text."""
    tokenizer = v4_tokenizer()
    pieces = text.split(DSML)
    ids: list[int] = []
    for i, plain in enumerate(tokenizer.encode_plain(pieces)):
        if i:
            ids.append(tokenizer.special_token_id(DSML))
        ids.extend(plain)
    return ids


def accepts(grammar_tokenizer, grammar: str, text: str) -> bool:
    """The whole of `text`, then end of sequence, matches the grammar."""
    matcher = llguidance.LLMatcher(
        grammar_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
    )
    assert not matcher.is_error(), matcher.get_error()
    return (
        all(matcher.consume_token(t) for t in token_ids(text))
        and matcher.is_accepting()
        and matcher.consume_token(EOS_ID)
    )


def call(name: str, arguments: dict | None = None, call_id: str = "1") -> ToolCall:
    return ToolCall(call_id, name, json.dumps(arguments or {}, ensure_ascii=False))


RENDERED_CALLS = {
    "enum and bounded integer": [call("get_weather", {"city": "Rome", "days": 3})],
    "optional string with markup": [call("get_weather", {"city": "Zürich", "note": "a<b c\n"})],
    "no parameters at all": [call("ping")],
    "empty properties": [call("now")],
    "all optional, none given": [call("set_flags")],
    "all optional, the last given": [call("set_flags", {"ids": [1, -2, 30]})],
    "all optional, both given": [call("set_flags", {"on": False, "ids": []})],
    "ref, pattern and string array": [
        call("move", {"to": {"x": 1.5, "y": -2}, "code": "AB7", "tags": ["é", "</x"]})
    ],
    "several calls": [
        call("ping", None, "1"),
        call("get_weather", {"city": "Paris"}, "2"),
        call("set_flags", {"on": True}, "3"),
    ],
}


@pytest.mark.parametrize("calls", RENDERED_CALLS.values(), ids=RENDERED_CALLS.keys())
def test_accepts_the_call_blocks_the_encoder_renders(grammar_tokenizer, encoding, calls):
    grammar = encoding.tool_call_grammar(TOOLS)
    assert accepts(grammar_tokenizer, grammar, rendered_block(encoding, calls))


def weather(encoding, *, city="Paris", days="3", note=None) -> str:
    """A V4/V4.1 call block for get_weather, spelled by hand so it can be broken."""
    _, invoke, parameter = encoding.tag_names
    lines = [f'<{DSML}{invoke} name="get_weather">']
    if city is not None:
        lines.append(f'<{DSML}{parameter} name="city" string="true">{city}</{DSML}{parameter}>')
    if days is not None:
        lines.append(f'<{DSML}{parameter} name="days" string="false">{days}</{DSML}{parameter}>')
    if note is not None:
        lines.append(f'<{DSML}{parameter} name="note" string="true">{note}</{DSML}{parameter}>')
    lines.append(f"</{DSML}{invoke}>")
    return "\n".join(lines) + f"\n</{DSML}{encoding.tag_names[0]}>"


def test_the_hand_spelled_call_is_well_formed(grammar_tokenizer, encoding):
    grammar = encoding.tool_call_grammar([WEATHER])
    assert accepts(grammar_tokenizer, grammar, weather(encoding, note="ok"))


MALFORMED = {
    "value outside the enum": {"city": "Berlin"},
    "missing required parameter": {"city": None},
    "integer above the maximum": {"days": "8"},
    "integer as a JSON string": {"days": '"3"'},
    "string longer than maxLength": {"note": "thirteen char"},
    "string value holding the value terminator": {"note": "a</b"},
}


@pytest.mark.parametrize("change", MALFORMED.values(), ids=MALFORMED.keys())
def test_rejects_malformed_parameter_values(grammar_tokenizer, encoding, change):
    grammar = encoding.tool_call_grammar([WEATHER])
    assert not accepts(grammar_tokenizer, grammar, weather(encoding, **change))


def test_rejects_a_misplaced_or_unknown_block(grammar_tokenizer, encoding):
    grammar = encoding.tool_call_grammar([WEATHER])
    good = weather(encoding)
    calls_close = f"</{DSML}{encoding.tag_names[0]}>"
    for text in [
        good.replace("get_weather", "get_time"),  # undeclared tool
        "Sure!\n" + good,  # text before the first invoke
        good.removesuffix(calls_close),  # never closed
        good + "\nmore",  # text after the block
        calls_close,  # no invoke at all
        good.replace('"days" string="false">3', '"days" string="true">3'),  # wrong flag
    ]:
        assert not accepts(grammar_tokenizer, grammar, text), text


def test_parameters_follow_the_schema_order(grammar_tokenizer, encoding):
    grammar = encoding.tool_call_grammar([WEATHER])
    lines = weather(encoding).split("\n")
    swapped = "\n".join([lines[0], lines[2], lines[1], *lines[3:]])
    assert not accepts(grammar_tokenizer, grammar, swapped)


def test_json_values_are_spelled_as_the_encoder_writes_them(grammar_tokenizer, encoding):
    grammar = encoding.tool_call_grammar([FLAGS])
    block = rendered_block(encoding, [call("set_flags", {"ids": [1, 2]})], [FLAGS])
    assert "[1, 2]" in block
    assert not accepts(grammar_tokenizer, grammar, block.replace("[1, 2]", "[1,2]"))
    assert not accepts(grammar_tokenizer, grammar, block.replace("[1, 2]", "[1,  2]"))


def test_each_version_keeps_its_own_tags_and_empty_invoke(grammar_tokenizer):
    v4 = DeepseekV4Encoding().with_tokenizer(v4_tokenizer())
    v41 = DeepseekV41Encoding().with_tokenizer(v4_tokenizer())
    v4_block = rendered_block(v4, [call("ping")])
    v41_block = rendered_block(v41, [call("ping")])
    # V4 has one newline inside a call without parameters, V4.1 two.
    assert 'name="ping">\n</' in v4_block
    assert 'name="ping">\n\n</' in v41_block
    assert not accepts(grammar_tokenizer, v41.tool_call_grammar(TOOLS), v4_block)
    assert not accepts(grammar_tokenizer, v4.tool_call_grammar(TOOLS), v41_block)
    v41_spaced_like_v4 = v41_block.replace('name="ping">\n\n</', 'name="ping">\n</')
    assert not accepts(grammar_tokenizer, v41.tool_call_grammar(TOOLS), v41_spaced_like_v4)


def test_unanchored_pattern_may_match_inside_the_value(grammar_tokenizer):
    tags = DsmlTags(" calls", " invoke", " parameter", "\n", 128825)
    tool = ToolDefinition("f", None, obj({"s": {"type": "string", "pattern": "a/b"}}, ["s"]))
    grammar = tool_call_grammar([tool], tags)
    block = (
        f'<{DSML} invoke name="f">\n<{DSML} parameter name="s" string="true">{{}}'
        f"</{DSML} parameter>\n</{DSML} invoke>\n</{DSML} calls>"
    )
    assert accepts(grammar_tokenizer, grammar, block.format("xa/by"))
    assert not accepts(grammar_tokenizer, grammar, block.format("ab"))


def test_a_grammar_needs_a_tool():
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_grammar([], DsmlTags(" calls", " invoke", " parameter", "\n", 128825))
