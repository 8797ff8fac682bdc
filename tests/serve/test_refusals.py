"""What the server refuses and how it says so: OpenAI's built-in tools, a forced tool call in
thinking mode (with how to turn thinking off). Through the official SDKs, in-process."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from deepwell.serve.api import create_app
from tests.serve.test_errors import MODEL, sdk_clients

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


@pytest.mark.parametrize("kind", ["web_search_preview", "web_search", "file_search"])
def test_a_builtin_responses_tool_is_a_400_naming_it(kind):
    openai_client, _ = sdk_clients(create_app())
    function = {"type": "function", "name": "get_weather", "parameters": WEATHER}

    async def run():
        with pytest.raises(openai.BadRequestError) as refused:
            await openai_client.responses.create(
                model=MODEL, input="Weather in Paris?", tools=[function, {"type": kind}]
            )
        answered = await openai_client.responses.create(
            model=MODEL, input="Weather in Paris?", tools=[function]
        )
        return refused.value, answered

    refused, answered = asyncio.run(run())
    assert f"'{kind}' (tools[1])" in refused.body["message"]
    assert refused.body["param"] == "tools[1]"
    assert answered.output_text


def test_a_forced_tool_call_in_thinking_mode_says_how_to_turn_thinking_off():
    openai_client, anthropic_client = sdk_clients(create_app())
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": chat_tools,
        "tool_choice": "required",
    }
    message = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }

    async def run():
        with pytest.raises(openai.BadRequestError) as chat_refused:
            await openai_client.chat.completions.create(**chat)
        with pytest.raises(anthropic.BadRequestError) as message_refused:
            await anthropic_client.messages.create(**message)
        # The hint is right: with thinking off the same requests are served.
        disabled = {"thinking": {"type": "disabled"}}
        served_chat = await openai_client.chat.completions.create(**chat, extra_body=disabled)
        served_message = await anthropic_client.messages.create(**message, **disabled)
        return chat_refused.value, message_refused.value, served_chat, served_message

    chat_refused, message_refused, served_chat, served_message = asyncio.run(run())
    assert chat_refused.body["message"].startswith("Thinking mode does not support")
    assert '"thinking": {"type": "disabled"}' in chat_refused.body["message"]
    assert '"thinking": {"type": "disabled"}' in message_refused.body["error"]["message"]
    assert served_chat.choices[0].finish_reason == "stop"
    assert served_message.type == "message"
