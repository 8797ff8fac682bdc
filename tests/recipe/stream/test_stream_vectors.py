"""Every `stream` case of recipe_vectors.json, replayed in each dialect it was recorded for.

Outputs must equal the recorded ones byte for byte, after the vectors' own normalisation.
"""

from __future__ import annotations

import pytest
from stream_cases import CREATED, parsing_options, replay, stream_cases, tokenizer

from deepwell.recipe.conversion import ConversionOptions
from deepwell.recipe.dialects.chat import ChatCompletionRequest
from deepwell.recipe.dialects.chat_output import ChatCompletionResponse
from deepwell.recipe.dialects.messages import MessagesRequest
from deepwell.recipe.dialects.messages_output import MessagesResponse
from deepwell.recipe.dialects.responses import ResponsesRequest
from deepwell.recipe.dialects.responses_output import ResponsesResponse
from deepwell.recipe.stream.processor import StreamProcessor

REQUESTS = {
    "chat": (ChatCompletionRequest, ChatCompletionResponse),
    "responses": (ResponsesRequest, ResponsesResponse),
    "messages": (MessagesRequest, MessagesResponse),
}
RUNS = [
    pytest.param(case, dialect, id=f"{case['name']}-{dialect}")
    for case in stream_cases()
    for dialect in case["dialects"]
]


@pytest.mark.parametrize(("case", "dialect"), RUNS)
def test_stream_vector(case: dict, dialect: str) -> None:
    recorded = case["dialects"][dialect]
    request_class, response_class = REQUESTS[dialect]
    converted = request_class(recorded["request"]).convert(ConversionOptions())
    generator = request_class.chunk_generator(converted, "resp-0001", "model-x")
    if "with_signature" in recorded:
        generator = generator.with_signature(recorded["with_signature"])
    override = recorded.get("parsing_options_override")
    options = parsing_options(override) if override else converted.parsing_options
    processor = StreamProcessor(
        generator, options, tokenizer() if case.get("uses_tokenizer") else None
    )
    response = response_class("resp-0001", "model-x", CREATED, 0, 0)
    got = replay(processor, response, case["inference_chunks"])
    expected = {
        k: v
        for k, v in recorded.items()
        if k not in ("request", "parsing_options", "parsing_options_override", "with_signature")
    }
    assert got == expected
