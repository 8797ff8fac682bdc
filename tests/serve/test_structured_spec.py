"""Output constraints → the engine's structured output spec, trigger included."""

from __future__ import annotations

import pytest
import tokenizers

from deepwell.recipe import ChatCompletionRequest, ConversionOptions, Tokenizer
from deepwell.serve.frontend import structured_output_spec

THINK_END_ID = 1


def tokenizer_with_think_end() -> Tokenizer:
    words = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"<unk>": 0, "</think>": THINK_END_ID}, unk_token="<unk>")
    )
    words.add_special_tokens(["</think>"])
    return Tokenizer.from_str(words.to_str())


TOKENIZER = tokenizer_with_think_end()
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def spec(response_format: dict, *, thinking: bool, tools: list | None = None):
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": "json please"}],
        "thinking": {"type": "enabled" if thinking else "disabled"},
        "response_format": response_format,
    }
    if tools:
        body["tools"] = tools
    converted = ChatCompletionRequest(body).convert(ConversionOptions())
    return structured_output_spec(converted, converted.parsing_options, TOKENIZER)


def test_thinking_mode_constrains_only_after_the_end_of_thinking():
    result = spec(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}, thinking=True
    )
    assert result.kind == "json_schema"
    assert result.trigger_token_ids == [THINK_END_ID]


def test_without_thinking_the_grammar_starts_at_once():
    result = spec({"type": "regex", "regex": "[a-z]+"}, thinking=False)
    assert (result.kind, result.spec, result.trigger_token_ids) == ("regex", "[a-z]+", [])


@pytest.mark.parametrize(
    ("response_format", "kind"),
    [({"type": "json_object"}, "json_object"), ({"type": "text"}, None)],
)
def test_json_object_and_text(response_format, kind):
    result = spec(response_format, thinking=False)
    assert (result and result.kind) == kind
