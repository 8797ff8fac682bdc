"""Output constraints → the engine's structured output spec, trigger included."""

from __future__ import annotations

import json

import pytest
import tokenizers

from deepwell.recipe import (
    ChatCompletionRequest,
    ConversionOptions,
    DeepseekV41Encoding,
    Tokenizer,
)
from deepwell.serve.frontend import structured_output_spec
from deepwell.serve.model import ServedModel

THINK_END_ID = 1
DSML_ID = 2


def tokenizer_with_specials() -> Tokenizer:
    vocab = {"<unk>": 0, "</think>": THINK_END_ID, "｜DSML｜": DSML_ID}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    words.add_special_tokens(["</think>", "｜DSML｜"])
    return Tokenizer.from_str(words.to_str())


TOKENIZER = tokenizer_with_specials()
MODEL = ServedModel(
    names=("DeepSeek-V4.1-Flash",),
    conversion_options=ConversionOptions(),
    context_limit=4096,
    tokenizer=TOKENIZER,
    tool_call_grammar=DeepseekV41Encoding().with_tokenizer(TOKENIZER).tool_call_grammar,
)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


def spec(
    response_format: dict | None,
    *,
    thinking: bool,
    tools: list | None = None,
    tool_choice: object = None,
):
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": "json please"}],
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if response_format:
        body["response_format"] = response_format
    if tools:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    converted = ChatCompletionRequest(body).convert(ConversionOptions())
    return structured_output_spec(converted, converted.parsing_options, MODEL)


def test_thinking_mode_constrains_only_after_the_end_of_thinking():
    result = spec(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}, thinking=True
    )
    assert result.kind == "json_schema"
    assert result.trigger_token_ids == (THINK_END_ID,)


def test_without_thinking_the_grammar_starts_at_once():
    result = spec({"type": "regex", "regex": "[a-z]+"}, thinking=False)
    assert (result.kind, result.spec, result.trigger_token_ids) == ("regex", "[a-z]+", ())


@pytest.mark.parametrize(
    ("response_format", "kind"),
    [({"type": "json_object"}, "json_object"), ({"type": "text"}, None)],
)
def test_json_object_and_text(response_format, kind):
    result = spec(response_format, thinking=False)
    assert (result and result.kind) == kind


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "f"}}]
)
def test_a_forced_tool_call_must_match_the_dsml_grammar(tool_choice):
    result = spec(None, thinking=False, tools=[TOOL], tool_choice=tool_choice)
    assert (result.kind, result.trigger_token_ids) == ("ebnf", ())
    assert f"dsml: <[{DSML_ID}]>" in result.spec
    assert 'invoke name=\\"f\\">' in result.spec


def test_tool_choice_auto_leaves_calls_unconstrained():
    assert spec(None, thinking=False, tools=[TOOL], tool_choice="auto") is None


BOUNDED = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
        "owner": {"$ref": "#/$defs/person"},
    },
    "required": ["tags", "owner"],
    "$defs": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}
    },
}


@pytest.mark.parametrize("strict", [False, True])
def test_the_grammar_follows_the_users_schema_not_the_normalised_text(strict):
    result = spec(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": BOUNDED, "strict": strict}},
        thinking=False,
    )
    schema = json.loads(result.spec)
    assert schema["properties"]["tags"]["minItems"] == 2
    person = schema["$defs"]["person"]
    assert person["properties"]["name"]["maxLength"] == 8
    # Strict mode closes every object and requires all its properties, $defs included.
    closed = {"additionalProperties": False, "required": ["name"]}
    assert (person.items() >= closed.items()) is strict
