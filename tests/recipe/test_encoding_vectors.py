"""Every rendering and token-id vector recorded from deepseek_recipe 0.2.0 matches byte for byte.

Covers direct_render, render_matrix, python_api and the renderings of converted requests.
"""

from __future__ import annotations

import pytest
from vector_cases import cases, conversation, v4_tokenizer, v41_assumed_tokenizer

from deepwell.recipe import (
    AssistantMessage,
    Conversation,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    SpecialTokens,
    ToolDefinition,
    UserMessage,
)

ENCODINGS = {"v4": DeepseekV4Encoding, "v41": DeepseekV41Encoding}

RENDER_CASES = [c for c in cases("direct_render") + cases("conversion") if "render" in c]


def _conversation_of(case: dict) -> Conversation:
    summary = case.get("conversation") or case["converted"]["conversation"]
    return conversation(summary)


def _check_rendering(encoding, conv: Conversation, expected: dict) -> None:
    rendered = encoding.render_conversation(conv)
    assert rendered.prompt == expected["prompt"]
    assert rendered.special_ranges == [(a, b) for a, b, _ in expected["special_ranges"]]
    if "image_sources" in expected:
        got = [(s.kind, s.url, s.data_url, s.detail) for s in rendered.image_sources]
        want = [
            (s["kind"], s["url"], s["data_url"], s["detail"]) for s in expected["image_sources"]
        ]
        assert got == want


@pytest.mark.parametrize("case", RENDER_CASES, ids=lambda c: c["name"])
def test_rendering_matches_reference(case: dict) -> None:
    conv = _conversation_of(case)
    override = case.get("special_tokens_override")
    for key, expected in case["render"].items():
        if key == "token_ids":
            continue
        encoding = ENCODINGS[key]()
        if override:
            encoding = encoding.with_special_tokens(SpecialTokens(**override))
        _check_rendering(encoding, conv, expected)


@pytest.mark.parametrize(
    "case", [c for c in RENDER_CASES if "token_ids" in c["render"]], ids=lambda c: c["name"]
)
def test_token_ids_match_reference(case: dict) -> None:
    conv = _conversation_of(case)
    runs = {
        "v4": (DeepseekV4Encoding, v4_tokenizer()),
        "v41_bundled": (DeepseekV41Encoding, v4_tokenizer()),
        "v41_assumed": (DeepseekV41Encoding, v41_assumed_tokenizer()),
    }
    for key, expected in case["render"]["token_ids"].items():
        encoding_class, tokenizer = runs[key]
        encoding = encoding_class().with_tokenizer(tokenizer)
        if isinstance(expected, dict):
            with pytest.raises(RuntimeError) as error:
                encoding.encode(conv)
            assert str(error.value) == expected["error"]["message"]
        else:
            assert encoding.encode(conv) == expected


@pytest.mark.parametrize(
    "row",
    cases("render_matrix")[0]["rows"],
    ids=lambda r: "-".join(str(v) for v in r.values())[:60],
)
def test_assistant_turn_matrix(row: dict) -> None:
    conv = Conversation(
        [
            UserMessage("q"),
            AssistantMessage(
                row["content"], reasoning_content=row["reasoning_content"], prefix=row["prefix"]
            ),
        ],
        thinking_mode=row["thinking_mode"],
        reasoning_effort="low",
        tools=[ToolDefinition("f")] if row["tools"] else None,
    )
    for key, encoding_class in ENCODINGS.items():
        prompt = encoding_class().render_conversation(conv).prompt
        after = prompt[prompt.index("<｜User｜>q") + len("<｜User｜>q") :]
        assert after == row[key + "_after_user"]
