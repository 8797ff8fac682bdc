"""A tiny random DeepSeek-V4.1 checkpoint served for real, driven with the official SDKs.

The weights are noise, so the words are too: the tests check shapes. The prompt is V4.1's,
thinking on and off shape the reply, and forced tool calls (kept on track by the DSML
grammar) come back as parsed calls in all three dialects, streamed or not.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from deepwell.recipe import (
    Conversation,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    Tokenizer,
    UserMessage,
)

QUESTION = "What is the weather in Paris?"
# Forced calls: a few calls of ~60 tokens each fit; the grammar ends them with EOS.
CALL_TOKENS = 400
# Every value is bounded (enums, booleans, small integers, short strings), so a random
# model cannot wander off inside one.
TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "metric": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["city", "days", "metric"],
    },
    "lookup": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "maxLength": 6},
            "exact": {"type": "boolean"},
        },
        "required": ["code"],
    },
}
NAMED = "lookup"
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def openai_client(v41_server):
    return openai.OpenAI(base_url=f"{v41_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(v41_server):
    return anthropic.Anthropic(base_url=v41_server.base_url, api_key="unused", max_retries=0)


def check_calls(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    """At least one call, each of an allowed tool, with JSON arguments its schema accepts."""
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), TOOLS[name])


# --- the model and its prompt ---


def test_the_checkpoint_is_listed(v41_server, openai_client, anthropic_client):
    name = Path(v41_server.process.args[v41_server.process.args.index("--model") + 1]).name
    assert [m.id for m in openai_client.models.list()] == [name]
    assert [m.id for m in anthropic_client.models.list()] == [name]


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_prompts_are_rendered_with_the_v41_encoding(v41_server, openai_client, thinking):
    args = v41_server.process.args
    tokenizer = Tokenizer.from_file(Path(args[args.index("--model") + 1]) / "tokenizer.json")
    conversation = Conversation([UserMessage(QUESTION)], thinking_mode=thinking)
    expected = len(DeepseekV41Encoding().with_tokenizer(tokenizer).encode(conversation))
    if thinking:
        # V4's effort text is another: the count tells the two encodings apart.
        assert expected != len(DeepseekV4Encoding().with_tokenizer(tokenizer).encode(conversation))
    completion = openai_client.chat.completions.create(
        model=v41_server.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=1,
        extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}},
    )
    assert completion.usage.prompt_tokens == expected


# --- thinking on and off ---

REPLY_TOKENS = 6


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_chat_reasoning_follows_the_thinking_mode(v41_server, openai_client, thinking):
    completion = openai_client.chat.completions.create(
        model=v41_server.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=REPLY_TOKENS,
        temperature=0,
        extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}},
    )
    choice, usage = completion.choices[0], completion.usage
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= usage.completion_tokens <= REPLY_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = choice.message.model_extra or {}
    if thinking:
        assert isinstance(extra["reasoning_content"], str)
        assert usage.completion_tokens_details.reasoning_tokens >= 1
    else:
        assert "reasoning_content" not in extra
        assert isinstance(choice.message.content, str)


@pytest.mark.parametrize("effort", ["high", "none"])
def test_responses_reasoning_follows_the_effort(v41_server, openai_client, effort):
    response = openai_client.responses.create(
        model=v41_server.model,
        input=QUESTION,
        max_output_tokens=REPLY_TOKENS,
        temperature=0,
        reasoning={"effort": effort},
    )
    kinds = [item.type for item in response.output]
    assert response.status in ("completed", "incomplete")
    assert 1 <= response.usage.output_tokens <= REPLY_TOKENS
    if effort == "none":
        assert "reasoning" not in kinds
    else:
        assert kinds[0] == "reasoning"
        assert response.usage.output_tokens_details.reasoning_tokens >= 1


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_messages_thinking_block_follows_the_thinking_mode(v41_server, anthropic_client, thinking):
    message = anthropic_client.messages.create(
        model=v41_server.model,
        max_tokens=REPLY_TOKENS,
        messages=[{"role": "user", "content": QUESTION}],
        thinking={"type": "enabled", "budget_tokens": 1024} if thinking else {"type": "disabled"},
        extra_body={"temperature": 0},
    )
    kinds = [block.type for block in message.content]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= message.usage.output_tokens <= REPLY_TOKENS
    if thinking:
        assert kinds[0] == "thinking"
    else:
        assert "thinking" not in kinds


# --- forced tool calls ---

CHAT_CHOICES = {
    "required": ("required", set(TOOLS)),
    "named": ({"type": "function", "function": {"name": NAMED}}, {NAMED}),
}


@pytest.mark.parametrize("choice", CHAT_CHOICES)
def test_chat_forced_tool_calls_come_back_parsed(v41_server, openai_client, choice):
    tool_choice, allowed = CHAT_CHOICES[choice]
    request = {
        "model": v41_server.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [
            {"type": "function", "function": {"name": name, "parameters": parameters}}
            for name, parameters in TOOLS.items()
        ],
        "tool_choice": tool_choice,
        "max_tokens": CALL_TOKENS,
        "temperature": 0,
        "extra_body": NO_THINKING,
    }
    completion = openai_client.chat.completions.create(**request)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    check_calls(calls, allowed)

    streamed: dict[int, list[str]] = {}
    finish_reasons = []
    for chunk in openai_client.chat.completions.create(**request, stream=True):
        for streamed_choice in chunk.choices:
            for delta in streamed_choice.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            if streamed_choice.finish_reason:
                finish_reasons.append(streamed_choice.finish_reason)
    assert finish_reasons == ["tool_calls"]
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls


RESPONSES_CHOICES = {
    "required": ("required", set(TOOLS)),
    "named": ({"type": "function", "name": NAMED}, {NAMED}),
}


@pytest.mark.parametrize("choice", RESPONSES_CHOICES)
def test_responses_forced_tool_calls_come_back_as_function_calls(v41_server, openai_client, choice):
    tool_choice, allowed = RESPONSES_CHOICES[choice]
    request = {
        "model": v41_server.model,
        "input": QUESTION,
        "tools": [
            {"type": "function", "name": name, "parameters": parameters}
            for name, parameters in TOOLS.items()
        ],
        "tool_choice": tool_choice,
        "max_output_tokens": CALL_TOKENS,
        "temperature": 0,
        "reasoning": {"effort": "none"},
    }
    response = openai_client.responses.create(**request)
    assert response.status == "completed"
    calls = [
        (item.name, item.arguments) for item in response.output if item.type == "function_call"
    ]
    check_calls(calls, allowed)

    deltas: dict[str, str] = {}
    done: dict[str, str] = {}
    final = None
    for event in openai_client.responses.create(**request, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas[event.item_id] = deltas.get(event.item_id, "") + event.delta
        elif event.type == "response.function_call_arguments.done":
            done[event.item_id] = event.arguments
        elif event.type == "response.completed":
            final = event.response
    assert deltas == done
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == calls


def test_messages_forced_tool_use_comes_back_as_tool_use_blocks(v41_server, anthropic_client):
    # Messages' {"type": "any"} means auto here; a named tool is the forced choice.
    request = {
        "model": v41_server.model,
        "max_tokens": CALL_TOKENS,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [
            {"name": name, "description": "", "input_schema": parameters}
            for name, parameters in TOOLS.items()
        ],
        "tool_choice": {"type": "tool", "name": NAMED},
        "thinking": {"type": "disabled"},
        "extra_body": {"temperature": 0},
    }
    message = anthropic_client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    uses = [(block.name, block.input) for block in message.content if block.type == "tool_use"]
    check_calls([(name, json.dumps(arguments)) for name, arguments in uses], {NAMED})

    partial: dict[int, str] = {}
    with anthropic_client.messages.stream(**request) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [json.loads(partial[i]) for i in sorted(partial)] == [arguments for _, arguments in uses]
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == uses


def test_count_tokens_counts_what_the_model_reads_tools_included(v41_server, anthropic_client):
    request = {
        "model": v41_server.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "system": "Answer briefly.",
    }
    tools = [
        {"name": name, "description": "", "input_schema": parameters}
        for name, parameters in TOOLS.items()
    ]
    bare = anthropic_client.messages.count_tokens(**request).input_tokens
    counted = anthropic_client.messages.count_tokens(**request, tools=tools).input_tokens
    usage = anthropic_client.messages.create(**request, tools=tools, max_tokens=1).usage
    read = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert counted == read > bare


# --- bad input ---


def test_a_prompt_beyond_the_context_is_a_400_and_the_server_keeps_serving(
    v41_server, openai_client, anthropic_client
):
    too_long = "word " * 5000  # > 4096 tokens (--max-model-len)
    with pytest.raises(openai.BadRequestError) as chat_error:
        openai_client.chat.completions.create(
            model=v41_server.model,
            messages=[{"role": "user", "content": too_long}],
            max_tokens=4,
            extra_body=NO_THINKING,
        )
    assert chat_error.value.status_code == 400
    assert "maximum context length is 4096 tokens" in chat_error.value.message
    with pytest.raises(openai.BadRequestError) as responses_error:
        openai_client.responses.create(model=v41_server.model, input=too_long, max_output_tokens=4)
    assert responses_error.value.status_code == 400
    with pytest.raises(anthropic.BadRequestError) as messages_error:
        anthropic_client.messages.create(
            model=v41_server.model, max_tokens=4, messages=[{"role": "user", "content": too_long}]
        )
    assert messages_error.value.status_code == 400
    assert messages_error.value.body["type"] == "error"
    assert messages_error.value.body["error"]["type"] == "invalid_request_error"

    completion = openai_client.chat.completions.create(
        model=v41_server.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=2,
        extra_body=NO_THINKING,
    )
    assert completion.usage.completion_tokens >= 1
