"""Hermes and Llama-3 JSON tool calls through the StreamProcessor, as Chat chunks.

Calls stream as DSML ones do: a call when its name is read, then argument text as it is
generated; output that only looks like a call stays content.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from deepwell.recipe import (
    ChatCompletionChunkGenerator,
    ChatCompletionResponse,
    InferenceChunk,
    InferenceFinishReason,
    ParsingOptions,
    StreamProcessor,
    Tokenizer,
    ToolDefinition,
)
from deepwell.recipe.encoding.json_call_grammar import json_call_grammar

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


def run(pieces: list[str], fmt: str = "hermes", **options) -> tuple[list, dict]:
    """Push `pieces` as text chunks; return the events and the accumulated Chat message."""
    generator = ChatCompletionChunkGenerator("id", "m", None)
    processor = StreamProcessor(generator, ParsingOptions(tool_call_format=fmt, **options))
    events = [InferenceChunk.ready(), *(InferenceChunk.text(p, 1) for p in pieces)]
    out = []
    for chunk in [*events, InferenceChunk.finish(InferenceFinishReason.Stop)]:
        if processor.finished:
            break
        out += processor.push(chunk)
    response = ChatCompletionResponse("id", "m", 0, 0, 0)
    for event in out:
        response.accumulate(event)
    choice = json.loads(response.to_json())["choices"][0]
    return out, choice


def calls(choice: dict) -> list[tuple[str, object]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"].get("tool_calls") or []
    ]


def split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_call_is_parsed_whatever_the_chunking(size: int) -> None:
    _, choice = run(split(CALL, size))
    assert calls(choice) == [("get_weather", {"city": "Paris", "days": [1, 2]})]
    assert choice["finish_reason"] == "tool_calls"
    assert not choice["message"]["content"]


def test_hermes_arguments_stream_before_the_call_closes() -> None:
    generator = ChatCompletionChunkGenerator("id", "m", None)
    processor = StreamProcessor(generator, ParsingOptions(tool_call_format="hermes"))
    processor.push(InferenceChunk.ready())
    events = processor.push(InferenceChunk.text(CALL[:60], 1))
    deltas = [json.loads(e.to_json())["choices"][0]["delta"] for e in events]
    streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert streamed[0]["function"]["name"] == "get_weather"
    assert "".join(s["function"].get("arguments", "") for s in streamed).startswith('{"city"')


def test_content_before_and_several_calls() -> None:
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n"
    _, choice = run(split(text, 5))
    assert choice["message"]["content"] == "Let me check."
    assert [args["city"] for _, args in calls(choice)] == ["Paris", "Rome"]


def test_arguments_before_name_and_compact_spelling() -> None:
    text = '<tool_call>{"arguments":{"q":"a}b"},"name":"search"}</tool_call>'
    _, choice = run(split(text, 4))
    assert calls(choice) == [("search", {"q": "a}b"})]


def test_call_without_arguments_gets_an_empty_object() -> None:
    _, choice = run(['<tool_call>\n{"name": "now"}\n</tool_call>'])
    assert calls(choice) == [("now", {})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"nme": "x"}\n</tool_call> done',
        "<tool_call> not json",
        "a < b and <tool_ca",
    ],
)
def test_what_is_no_call_stays_content(text: str) -> None:
    _, choice = run(split(text, 3))
    assert choice["message"]["content"] == text
    assert calls(choice) == []


def test_without_tools_the_tag_is_content() -> None:
    _, choice = run([CALL], parse_tool_calls=False)
    assert choice["message"]["content"] == CALL


def test_stop_sequence_ends_content() -> None:
    _, choice = run(["hello STOP more"], stop_sequences=["STOP"])
    assert choice["message"]["content"] == "hello "


def test_llama3_json_call_at_the_start() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    _, choice = run(split(text, 2), fmt="llama3_json")
    assert calls(choice) == [("get_weather", {"city": "Oslo"})]


def test_llama3_json_python_tag_and_several_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    _, choice = run(split(text, 3), fmt="llama3_json")
    assert calls(choice) == [("a", {}), ("b", {"x": 1})]


def test_llama3_json_text_answer_is_content() -> None:
    text = 'The JSON is {"name": "a"}'
    _, choice = run(split(text, 3), fmt="llama3_json")
    assert choice["message"]["content"] == text


def test_hermes_tags_that_are_added_tokens_are_matched_by_id() -> None:
    """Qwen's vocabulary has `<tool_call>` as one added token: only that id opens a call."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[AddedToken("<tool_call>"), AddedToken("</tool_call>")],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator([CALL] * 10, trainer)
    tokenizer = Tokenizer.from_str(hf.to_str())
    # A tag spelled with ordinary ids (as a user could type it) is content; the call's
    # tags are the added ids.
    ids = tokenizer.encode_plain(["<tool_call>"])[0] + tokenizer.encode(CALL)
    assert ids.count(tokenizer.special_token_id("<tool_call>")) == 1
    generator = ChatCompletionChunkGenerator("id", "m", None)
    processor = StreamProcessor(generator, ParsingOptions(tool_call_format="hermes"), tokenizer)
    out = processor.push(InferenceChunk.ready())
    for i in range(0, len(ids), 2):
        out += processor.push(InferenceChunk.tokens(ids[i : i + 2]))
    out += processor.push(InferenceChunk.finish(InferenceFinishReason.Stop))
    response = ChatCompletionResponse("id", "m", 0, 0, 0)
    for event in out:
        response.accumulate(event)
    choice = json.loads(response.to_json())["choices"][0]
    assert choice["message"]["content"] == "<tool_call>"
    assert calls(choice) == [("get_weather", {"city": "Paris", "days": [1, 2]})]

    grammar = json_call_grammar(
        [ToolDefinition("get_weather")], "hermes", tokenizer.special_token_id
    )
    open_id = tokenizer.special_token_id("<tool_call>")
    close_id = tokenizer.special_token_id("</tool_call>")
    assert f"open: <[{open_id}]>" in grammar and f"close: <[{close_id}]>" in grammar
