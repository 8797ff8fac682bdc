"""A repeated key in JSON text: serde_json keeps the last value but reads every one.

A value it refuses (`1e400`, a lone surrogate) spoils the whole text even when a later value
replaces it, so a Chat call's arguments render as one raw `arguments` parameter, as the
reference renders them (the Messages `tool_use` input and bodies: test_messages_output.py).
"""

from __future__ import annotations

from types import ModuleType

import deepseek_recipe as dr
import pytest

import deepwell.recipe as ours


def rendered(recipe: ModuleType, arguments: str) -> list[str]:
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
    }
    converted = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
    return [
        getattr(recipe, name)().render_conversation(converted.conversation).prompt
        for name in ("DeepseekV4Encoding", "DeepseekV41Encoding")
    ]


@pytest.mark.parametrize(
    ("arguments", "raw"),
    [
        ('{"a": 1e400, "a": 1}', True),
        ('{"a": "\\ud800", "a": 1}', True),
        ('{"a": 1, "a": 2}', False),
    ],
)
def test_call_arguments_with_a_refused_value_under_a_repeated_key_render_raw_like_reference(
    arguments: str, raw: bool
) -> None:
    prompts = rendered(ours, arguments)
    assert prompts == rendered(dr, arguments)
    whole = 'parameter name="arguments" string="true">'
    assert all((whole in prompt) == raw for prompt in prompts)
