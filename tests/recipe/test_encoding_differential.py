"""Random conversations rendered and encoded by deepseek_recipe and by us give identical results.

Prompt, special ranges, image sources and token ids (or the same error), V4 and V4.1 (V4.1
ids with the assumed tokenizer), with default and custom special-token spellings. The default profile runs a quick sample; `-m slow` runs thousands.
"""

from __future__ import annotations

import json
from functools import cache

import deepseek_recipe as dr
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vector_cases import (
    TOKENIZER_PATH,
    v4_tokenizer,
    v41_assumed_tokenizer,
    v41_assumed_tokenizer_json,
)

import deepwell.recipe as ours

REF_V4_TOKENIZER = dr.Tokenizer.from_file(str(TOKENIZER_PATH))
REF_V41_TOKENIZER = dr.Tokenizer.from_str(v41_assumed_tokenizer_json())

SPELLINGS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜System｜>",
    "<｜latest_reminder｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜image｜>",
    "<｜ref｜>",
    "<｜/ref｜>",
    "<｜box｜>",
    "<｜/box｜>",
    "<｜point｜>",
    "<｜/point｜>",
    "<｜polygon｜>",
    "<｜/polygon｜>",
    "<tool_result>",
    "</tool_result>",
    "<|im_start|>",
    "<｜place▁holder▁no▁799｜>",
]
FRAGMENTS = [
    "\n",
    "\n\n",
    " ",
    "  ",
    "\t",
    "hello",
    " world",
    "12345",
    "3.14",
    "深度求索",
    "日本語のテキスト",
    "한국어",
    "😀",
    "👩‍💻",
    "é",
    "\r\n",
    '"quoted"',
    "{}",
    "’",
    "\u200b",
]

text = st.lists(
    st.one_of(
        st.sampled_from(SPELLINGS),
        st.sampled_from(FRAGMENTS),
        st.text(max_size=12),
        st.text(alphabet="ab 1\n<>/｜", max_size=8),
    ),
    max_size=6,
).map("".join)

CALL_IDS = ["a", "b", "c", "call_0", "z", "", "B", "é"]

# The float spellings that differ between writers: around 1e-5 and 1e16, subnormals, the
# extremes, integral floats, -0.0.
small_floats = st.sampled_from(
    [1e-5, 2.5e-5, 1e-6, -2.5e-8, 1e-9, 1e-10, 1e-4, 0.1, 1.0, -0.0, 100.0, 1e15, 1e16, 1.5e16]
    + [1e21, 1e22, 1e-300, 5e-324, 2.2250738585072014e-308, 1e308, 1.7976931348623157e308]
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    small_floats,
    text,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def arguments(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 9))
    if kind <= 3:
        obj = draw(st.dictionaries(text, json_values, max_size=4))
        separators = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
        return json.dumps(obj, ensure_ascii=draw(st.booleans()), separators=separators)
    if kind == 4:
        return draw(
            st.sampled_from(
                [
                    "",
                    "{}",
                    " {} ",
                    "[1,2]",
                    '"s"',
                    "null",
                    '{"x": NaN}',
                    '{"x": Infinity}',
                    '{"x": 1e400}',
                    '{"x": -0}',
                    '{"x": 12345678901234567890123}',
                    '{"x": -9223372036854775809}',
                    '{"a": 1, "b": 2, "a": 3}',
                    '{"x": "\\ud800"}',
                    '{"x": "\\ud83d\\ude00"}',
                    '{"x": 1}x',
                    "\ufeff{}",
                    '{"x": 0.00001, "y": 1E5, "z": 123e-7}',
                    '{"x": 1e2, "y": 1.0, "z": -0.0, "w": 4.9e-324, "v": 1e-400}',
                    '{"x": 18446744073709551616, "y": 1' + "0" * 400 + "}",
                    '{"x": 1.7976931348623157e308, "y": 2.5E-8, "z": 1e-5}',
                    '{"x":' + "[" * 126 + "]" * 126 + "}",
                    '{"x":' + "[" * 127 + "]" * 127 + "}",
                ]
            )
        )
    if kind == 5:
        return draw(text)
    return json.dumps(
        draw(st.dictionaries(st.sampled_from(["q", "n", "path"]), json_scalars, max_size=3))
    )


def nested(depth: int) -> dict:
    """`depth` containers: objects and lists in turn, the outermost an object."""
    value: object = 1.5e-5
    for level in range(depth - 1, -1, -1):
        value = {"v": value} if level % 2 == 0 else [value]
    return value


# The Python→JSON bridge takes 128 nested containers and refuses 129 (spec/recipe.md §15.12).
deep_values = st.integers(120, 130).map(nested)

tool_definitions = st.builds(
    lambda name, description, parameters, defer: {
        "name": name,
        "description": description,
        "parameters": parameters,
        "defer_loading": defer,
    },
    st.sampled_from(["f", "get_weather", "g-2", "search"]),
    st.one_of(st.none(), text),
    st.one_of(st.none(), st.dictionaries(text, json_values, max_size=3), deep_values),
    st.booleans(),
)


@st.composite
def message(draw: st.DrawFn) -> dict:
    role = draw(
        st.sampled_from(
            ["system", "user", "user", "assistant", "assistant", "tool", "tool", "latest_reminder"]
        )
    )
    spec = {"role": role, "content": draw(text)}
    if role in ("system", "user", "tool"):
        spec["images"] = draw(st.integers(0, 2))
    if role == "system":
        spec["tools"] = draw(st.one_of(st.none(), st.lists(tool_definitions, max_size=2)))
    if role == "tool":
        spec["tool_call_id"] = draw(st.one_of(st.none(), st.sampled_from(CALL_IDS)))
    if role == "assistant":
        spec["reasoning_content"] = draw(st.one_of(st.none(), st.just(""), text))
        spec["tool_calls"] = draw(
            st.one_of(
                st.none(),
                st.lists(
                    st.tuples(st.sampled_from(CALL_IDS), st.sampled_from(["f", "g"]), arguments()),
                    max_size=3,
                ),
            )
        )
        spec["prefix"] = draw(st.booleans())
    return spec


@st.composite
def protocol_tool_round(draw: st.DrawFn) -> list[dict]:
    """An assistant with calls and one result per call, in any order: what conversion allows."""
    ids = draw(st.lists(st.sampled_from(CALL_IDS), min_size=1, max_size=3, unique=True))
    calls = [(i, draw(st.sampled_from(["f", "g"])), draw(arguments())) for i in ids]
    assistant = {
        "role": "assistant",
        "content": draw(text),
        "reasoning_content": draw(st.one_of(st.none(), st.just(""), text)),
        "tool_calls": calls,
        "prefix": False,
    }
    results = draw(st.permutations(ids))
    tools = [
        {
            "role": "tool",
            "content": draw(text),
            "tool_call_id": i,
            "images": draw(st.integers(0, 1)),
        }
        for i in results
    ]
    return [assistant, *tools]


conversations = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.one_of(message().map(lambda m: [m]), protocol_tool_round()), max_size=7
        ).map(lambda groups: [m for g in groups for m in g]),
        "thinking_mode": st.booleans(),
        "tools": st.lists(tool_definitions, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "reasoning_effort": st.sampled_from([None, "low", "high", "xhigh", "max"]),
        "format": st.sampled_from(["text", "json_object", "schema", "regex"]),
        "schema": st.one_of(st.dictionaries(text, json_values, max_size=2), deep_values),
        "special_tokens": st.sampled_from(
            [
                None,
                None,
                {"user": "<|user|>", "assistant": "<|assistant|>", "thinking_end": "</t>"},
                {"dsml": "|DSML|", "ref": "[ref]", "box_end": "[/box]", "eos": "<eos>"},
                {"system": "<｜User｜>", "latest_reminder": "<think>", "bos": "hello"},
            ]
        ),
    }
)


def build(module, spec: dict):
    """The same conversation as objects of `module` (deepseek_recipe or deepwell.recipe)."""

    def tool(t: dict):
        return module.ToolDefinition(
            t["name"], t["description"], t["parameters"], defer_loading=t["defer_loading"]
        )

    def images(n: int) -> list:
        return [module.UrlImageSource(f"https://example.invalid/{i}.png") for i in range(n)]

    messages = []
    for m in spec["messages"]:
        role, content = m["role"], m["content"]
        if role == "system":
            tools = None if m["tools"] is None else [tool(t) for t in m["tools"]]
            messages.append(module.SystemMessage(content, images(m["images"]), tools))
        elif role == "user":
            messages.append(module.UserMessage(content, images(m["images"])))
        elif role == "tool":
            messages.append(module.ToolMessage(content, m["tool_call_id"], images(m["images"])))
        elif role == "latest_reminder":
            messages.append(module.LatestReminderMessage(content))
        else:
            calls = m["tool_calls"]
            messages.append(
                module.AssistantMessage(
                    content,
                    m["reasoning_content"],
                    None if calls is None else [module.ToolCall(*c) for c in calls],
                    m["prefix"],
                )
            )
    fmt = spec["format"]
    return module.Conversation(
        messages,
        thinking_mode=spec["thinking_mode"],
        tools=[tool(t) for t in spec["tools"]],
        tool_choice=spec["tool_choice"],
        reasoning_effort=spec["reasoning_effort"],
        response_format="json_object" if fmt == "json_object" else "text",
        response_schema=spec["schema"] if fmt == "schema" else None,
        response_regex="[a-z]+" if fmt == "regex" else None,
    )


def _outcome(fn):
    try:
        return ("ok", fn())
    except (RuntimeError, ValueError) as error:
        return ("error", type(error).__name__, str(error))


def _rendered(encoding, conv) -> tuple:
    r = encoding.render_conversation(conv)
    return r.prompt, [tuple(x) for x in r.special_ranges], [s.url for s in r.image_sources]


@cache
def encoding_pairs(special_tokens: tuple | None) -> list[tuple]:
    """(reference, ours) encodings with tokenizers attached, made once per spelling set:
    the reference's with_tokenizer copies the whole tokenizer (tens of ms)."""
    pairs = [
        (
            dr.DeepseekV4Encoding().with_tokenizer(REF_V4_TOKENIZER),
            ours.DeepseekV4Encoding().with_tokenizer(v4_tokenizer()),
        ),
        (
            dr.DeepseekV41Encoding().with_tokenizer(REF_V41_TOKENIZER),
            ours.DeepseekV41Encoding().with_tokenizer(v41_assumed_tokenizer()),
        ),
    ]
    if special_tokens is None:
        return pairs
    spellings = dict(special_tokens)
    return [
        (
            reference.with_special_tokens(dr.SpecialTokens(**spellings)),
            mine.with_special_tokens(ours.SpecialTokens(**spellings)),
        )
        for reference, mine in pairs
    ]


def check_same(spec: dict) -> None:
    reference_conv = _outcome(lambda: build(dr, spec))
    our_conv = _outcome(lambda: build(ours, spec))
    if reference_conv[0] == "error":
        assert our_conv == reference_conv
        return
    assert our_conv[0] == "ok", our_conv
    reference_conv, our_conv = reference_conv[1], our_conv[1]
    spellings = spec["special_tokens"]
    for reference, mine in encoding_pairs(None if spellings is None else tuple(spellings.items())):
        assert _rendered(mine, our_conv) == _rendered(reference, reference_conv)
        assert _outcome(lambda m=mine: m.encode(our_conv)) == _outcome(
            lambda r=reference: r.encode(reference_conv)
        )


# The quick profile replays a fixed sample (stable in CI); the slow one explores afresh.
QUICK = settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
THOROUGH = settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))


@QUICK
@given(conversations)
def test_random_conversations_render_and_encode_like_reference(spec: dict) -> None:
    check_same(spec)


@pytest.mark.slow
@THOROUGH
@given(conversations)
def test_random_conversations_render_and_encode_like_reference_thoroughly(spec: dict) -> None:
    check_same(spec)


def _round(ids: list[str]) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "reasoning_content": None,
        "tool_calls": [(i, "f", "{}") for i in ids],
        "prefix": False,
    }


def _result(call_id: str) -> dict:
    return {"role": "tool", "content": call_id, "tool_call_id": call_id, "images": 0}


SYSTEM = {"role": "system", "content": "s", "images": 0, "tools": None}
REMINDER = {"role": "latest_reminder", "content": "r"}
USER = {"role": "user", "content": "u", "images": 0}
NO_CALLS = _round([]) | {"tool_calls": None}


# Results sort into the calls of the latest assistant that made any, also in runs that a
# system turn, a reminder or an assistant without calls separates from it (a case the
# random search found; V4 sorts by id and V4.1 by call order).
@pytest.mark.parametrize(
    "messages",
    [
        [_round(["a", "b"]), _result("a"), SYSTEM, _result("b"), _result("a")],
        [_round(["a", "b"]), SYSTEM, USER, _result("b"), _result("a")],
        [_round(["a", "b"]), REMINDER, _result("b"), _result("a")],
        [_round(["a", "b"]), _result("a"), _result("b"), NO_CALLS, _result("b"), _result("a")],
        [_round(["a", "b"]), _result("a"), _result("b"), _round([]), _result("b"), _result("a")],
        [_round(["b", "a"]), _result("a"), _result("b"), _round(["a", "b"]), SYSTEM]
        + [_result("b"), _result("a")],
        [_round(["a", "b"]), _result("b"), _result("a"), _round(["c"]), _result("b"), _result("a")],
        [USER, _result("b"), _result("a")],
    ],
)
def test_tool_results_sort_into_the_latest_calls_like_reference(messages: list[dict]) -> None:
    check_same(
        {
            "messages": messages,
            "thinking_mode": False,
            "tools": [],
            "tool_choice": "auto",
            "reasoning_effort": None,
            "format": "text",
            "schema": {},
            "special_tokens": None,
        }
    )


@pytest.mark.parametrize("depth", [64, 127, 128, 129, 200, 1000])
@pytest.mark.parametrize("where", ["tool", "response_schema"])
def test_deeply_nested_python_values_are_taken_or_refused_like_reference(
    where: str, depth: int
) -> None:
    spec = {
        "messages": [{"role": "user", "content": "json", "images": 0}],
        "thinking_mode": False,
        "tools": [],
        "tool_choice": "auto",
        "reasoning_effort": None,
        "format": "text",
        "schema": {},
        "special_tokens": None,
    }
    if where == "tool":
        spec["tools"] = [
            {"name": "f", "description": None, "parameters": nested(depth), "defer_loading": False}
        ]
    else:
        spec["format"], spec["schema"] = "schema", nested(depth)
    check_same(spec)
