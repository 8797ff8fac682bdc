"""Forced-call grammars of chat-template models (Hermes, Llama-3 JSON), compiled by llguidance.

They must accept the calls a Hermes template renders, as the model would write them, and
refuse undeclared tools and keys, values outside the schema, and text around the calls.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

import llguidance
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from deepwell.recipe import (
    AssistantMessage,
    ChatTemplateEncoding,
    Conversation,
    Tokenizer,
    ToolCall,
    ToolDefinition,
    UserMessage,
)
from deepwell.recipe.encoding.json_call_grammar import json_call_grammar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.models.tiny_qwen import HERMES_TEMPLATE  # noqa: E402

WEATHER = ToolDefinition(
    "get_weather",
    "Weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Zürich"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city"],
    },
)
PING = ToolDefinition("ping")
TOOLS = [WEATHER, PING]


@cache
def tokenizer_json(tags_are_tokens: bool) -> str:
    """A small byte-level BPE; EOS `<|im_end|>` is id 0, the Hermes tags optionally added."""
    specials = [AddedToken("<|im_end|>", special=True), AddedToken("<|im_start|>", special=True)]
    if tags_are_tokens:
        specials += [AddedToken("<tool_call>"), AddedToken("</tool_call>")]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(
        ['{"name": "get_weather", "arguments": {"city": "Paris"}}'] * 10, trainer
    )
    return hf.to_str()


@cache
def tokenizer(tags_are_tokens: bool) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json(tags_are_tokens))


def accepts(grammar: str, ids: list[int], tags_are_tokens: bool = False) -> bool:
    """All of `ids`, then end of sequence, match the grammar."""
    lltokenizer = llguidance.LLTokenizer(tokenizer_json(tags_are_tokens), eos_token=0)
    matcher = llguidance.LLMatcher(
        lltokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
    )
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in ids) and matcher.consume_token(0)


def hermes(tags_are_tokens: bool = False) -> str:
    return json_call_grammar(TOOLS, "hermes", tokenizer(tags_are_tokens).special_token_id)


def rendered_calls(calls: list[ToolCall]) -> str:
    """The assistant turn the Hermes template renders for `calls`, without its turn markers."""
    encoding = ChatTemplateEncoding(HERMES_TEMPLATE)
    prompt = encoding.render_conversation(
        Conversation([UserMessage("hi"), AssistantMessage("", tool_calls=calls)], tools=TOOLS)
    ).prompt
    turn = prompt[prompt.index("<|im_start|>assistant") + len("<|im_start|>assistant\n") :]
    return turn[: turn.index("<|im_end|>")]


def plain(text: str) -> list[int]:
    return tokenizer(False).encode_plain([text])[0]


def call(name: str, arguments: dict | None = None) -> ToolCall:
    return ToolCall("1", name, json.dumps(arguments or {}, ensure_ascii=False))


RENDERED = {
    "enum and integer": [call("get_weather", {"city": "Zürich", "days": 3})],
    "required only": [call("get_weather", {"city": "Paris"})],
    "no parameters": [call("ping")],
    "several calls": [call("ping"), call("get_weather", {"city": "Rome"})],
}


@pytest.mark.parametrize("calls", RENDERED.values(), ids=RENDERED.keys())
def test_hermes_accepts_the_calls_the_template_renders(calls):
    assert accepts(hermes(), plain(rendered_calls(calls)))


def test_hermes_refuses_what_the_schema_or_format_does_not_allow():
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(hermes(), plain(good))
    for text in [
        good.replace("get_weather", "get_time"),  # undeclared tool
        good.replace('"Paris"', '"Berlin"'),  # outside the enum
        good.replace('"Paris"}', '"Paris", "extra": 1}'),  # undeclared key
        good.replace('{"city": "Paris"}', "{}"),  # required key missing
        "Sure! " + good,  # text before the call
        good + " done",  # text after it
        good.removesuffix("</tool_call>"),  # never closed
    ]:
        assert not accepts(hermes(), plain(text)), text


def test_hermes_tags_that_are_added_tokens_must_be_those_tokens():
    vocabulary = tokenizer(True)
    text = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert accepts(hermes(True), vocabulary.encode(text), True)
    assert not accepts(hermes(True), vocabulary.encode_plain([text])[0], True)


def test_llama3_json_is_one_object_with_parameters():
    grammar = json_call_grammar(TOOLS, "llama3_json", tokenizer(False).special_token_id)
    good = '{"name": "get_weather", "parameters": {"city": "Rome", "days": 7}}'
    assert accepts(grammar, plain(good))
    assert not accepts(grammar, plain(good.replace("parameters", "arguments")))
    assert not accepts(grammar, plain(good + "; " + good))
