"""Every conversion vector recorded from deepseek_recipe 0.2.0 matches byte for byte.

Checks the converted summary or error, Responses echo and namespace map, then renders and
encodes *our* converted conversation and resolves max_tokens like the recorder did.
"""

from __future__ import annotations

import pytest
from conversion_summary import convert_case, error_record
from vector_cases import cases, v4_tokenizer, v41_assumed_tokenizer

import deepwell.recipe as recipe
from deepwell.recipe import DeepseekV4Encoding, DeepseekV41Encoding

CONVERSION_CASES = cases("conversion")
RECORDED_KEYS = ("error", "converted", "model_property", "echo", "namespace_tool_map")
BIG_CONTEXT = 1048576


@pytest.mark.parametrize("case", CONVERSION_CASES, ids=lambda c: c["name"])
def test_conversion_matches_reference(case: dict) -> None:
    record, _ = convert_case(recipe, case["dialect"], case["request"], case["conversion_options"])
    assert record == {k: case[k] for k in RECORDED_KEYS if k in case}


@pytest.mark.parametrize(
    "case", [c for c in CONVERSION_CASES if "render" in c], ids=lambda c: c["name"]
)
def test_converted_conversation_renders_and_encodes_like_reference(case: dict) -> None:
    _, converted = convert_case(
        recipe, case["dialect"], case["request"], case["conversion_options"]
    )
    conv = converted.conversation
    for key, encoding in (("v4", DeepseekV4Encoding()), ("v41", DeepseekV41Encoding())):
        rendered = encoding.render_conversation(conv)
        expected = case["render"][key]
        assert rendered.prompt == expected["prompt"]
        assert [list(r) for r in rendered.special_ranges] == [
            [a, b] for a, b, _ in expected["special_ranges"]
        ]
    ids = {}
    for key, encoding, tokenizer in (
        ("v4", DeepseekV4Encoding, v4_tokenizer()),
        ("v41_bundled", DeepseekV41Encoding, v4_tokenizer()),
        ("v41_assumed", DeepseekV41Encoding, v41_assumed_tokenizer()),
    ):
        try:
            ids[key] = encoding().with_tokenizer(tokenizer).encode(conv)
        except Exception as e:  # noqa: BLE001 - the recorded outcome may be an error
            ids[key] = {"error": error_record(recipe, e)}
    assert ids == case["render"]["token_ids"]

    expected_max = case["max_tokens"]
    prompt_tokens = len(ids[expected_max["from_ids"]])
    assert prompt_tokens == expected_max["prompt_tokens"]
    results = []
    for limit in (BIG_CONTEXT, prompt_tokens + 100, prompt_tokens):
        try:
            results.append(
                {
                    "context_limit": limit,
                    "max_tokens": converted.resolve_max_tokens(prompt_tokens, limit),
                }
            )
        except recipe.ConversionError as e:
            results.append({"context_limit": limit, "error": error_record(recipe, e)})
    assert results == expected_max["results"]


def test_second_convert_of_a_consumed_request_fails() -> None:
    request = recipe.ChatCompletionRequest({"model": "nope", "messages": []})
    with pytest.raises(recipe.ConversionError):
        request.convert(recipe.ConversionOptions())
    with pytest.raises(RuntimeError, match="protocol request has been consumed"):
        request.convert(recipe.ConversionOptions())
