"""Usage in streamed output: where Chat chunks carry `usage`, and how reasoning tokens count.

Each expectation was read off deepseek-recipe 0.2.0
(docs/recipe.md, "Stream usage and accumulation").
"""

from __future__ import annotations

import json

import pytest
from stream_cases import tokenizer

from deepwell.recipe import (
    ChatCompletionRequest,
    ConversionOptions,
    InferenceChunk,
    InferenceFinishReason,
    ParsingOptions,
    StreamProcessor,
    ThinkingInitialStage,
)

THINK_END = 128822


def chat_chunks(extra: dict) -> list[dict]:
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "x"}]}
    request = ChatCompletionRequest({**body, **extra}).convert(ConversionOptions())
    generator = ChatCompletionRequest.chunk_generator(request, "id", "m")
    processor = StreamProcessor(generator, request.parsing_options, tokenizer())
    events = processor.push(InferenceChunk.text("hi</think>yo", 2))
    events += processor.push(InferenceChunk.finish(InferenceFinishReason.Stop))
    return [json.loads(e.to_json()) for e in events]


@pytest.mark.parametrize(
    "extra",
    [
        {"stream": True},
        {"stream": True, "stream_options": {}},
        {"stream": True, "stream_options": {"include_usage": False}},
        {"stream": True, "stream_options": {"include_usage": None}},
    ],
)
def test_streamed_chunks_without_include_usage_have_no_usage_key(extra: dict) -> None:
    *body, last = chat_chunks(extra)
    assert len(body) == 3 and all("usage" not in chunk for chunk in body)
    assert last["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "extra", [{}, {"stream": False}, {"stream": True, "stream_options": {"include_usage": True}}]
)
def test_null_usage_on_every_chunk_unless_streaming_without_include_usage(extra: dict) -> None:
    *body, last = chat_chunks(extra)
    assert all(chunk["usage"] is None for chunk in body)
    assert last["usage"]["total_tokens"] == 2


def reasoning_tokens(chunks: list[InferenceChunk], with_tokenizer: bool = True) -> int | None:
    request = ChatCompletionRequest(
        {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "x"}]}
    ).convert(ConversionOptions())
    generator = ChatCompletionRequest.chunk_generator(request, "id", "m")
    options = ParsingOptions(thinking_initial_stage=ThinkingInitialStage.ReasoningStart)
    processor = StreamProcessor(generator, options, tokenizer() if with_tokenizer else None)
    events = []
    for chunk in chunks:
        events += processor.push(chunk)
    events += processor.finish()
    usage = json.loads(events[-1].to_json())["usage"]
    details = usage.get("completion_tokens_details")
    return None if details is None else details["reasoning_tokens"]


def test_reasoning_tokens_encode_the_whole_reasoning_text_again() -> None:
    ids = [tokenizer().encode(c)[0] for c in "hello"]
    # Five ids of one letter each are one token `hello` once encoded again.
    assert reasoning_tokens([InferenceChunk.tokens(ids), InferenceChunk.tokens([THINK_END])]) == 1


def test_reasoning_from_text_chunks_counts_too() -> None:
    hello = tokenizer().encode("hello")
    chunks = [InferenceChunk.tokens(hello), InferenceChunk.text("hello world again", 3)]
    assert reasoning_tokens(chunks) == len(tokenizer().encode("hellohello world again"))


def test_reasoning_tokens_need_a_tokenizer_not_a_token_chunk() -> None:
    text = [InferenceChunk.text("hello</think>world", 2)]
    assert reasoning_tokens(text) == 1
    assert reasoning_tokens(text, with_tokenizer=False) is None
    assert reasoning_tokens([]) == 0


def test_a_stream_cut_inside_reasoning_counts_all_of_it() -> None:
    ids = tokenizer().encode("hello world</th")
    chunks = [InferenceChunk.tokens(ids), InferenceChunk.finish(InferenceFinishReason.Length)]
    assert reasoning_tokens(chunks) == len(ids)
