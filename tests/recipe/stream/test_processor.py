"""StreamProcessor behaviour that the golden vectors do not pin down on their own.

Tool arguments stream as they arrive; held text is released as soon as it is settled.
"""

from __future__ import annotations

import json

import pytest
from stream_cases import tokenizer

from deepwell.recipe import (
    ChatCompletionChunkGenerator,
    InferenceChunk,
    InferenceFinishReason,
    ParsingOptions,
    StreamProcessor,
    ThinkingInitialStage,
)

CALL_HEAD = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="write">\n'
PARAM_HEAD = '<｜DSML｜ parameter name="text" string="true">'


def processor(**options: object) -> StreamProcessor:
    stage = options.pop("stage", None)
    generator = ChatCompletionChunkGenerator("id", "m", stage)
    return StreamProcessor(
        generator, ParsingOptions(thinking_initial_stage=stage, **options), tokenizer()
    )


def deltas(events: list) -> list[dict]:
    return [json.loads(e.to_json())["choices"][0]["delta"] for e in events]


def arguments(events: list) -> str:
    return "".join(
        d["tool_calls"][0]["function"]["arguments"]
        for d in deltas(events)
        if "tool_calls" in d and "id" not in d["tool_calls"][0]
    )


def test_argument_bytes_leave_with_the_chunk_that_completes_the_parameter_header() -> None:
    p = processor()
    p.push(InferenceChunk.text(CALL_HEAD, 1))
    events = p.push(InferenceChunk.text(PARAM_HEAD + 'He said "hi"\n', 1))
    # The value's first bytes are out, escaped, while the call is still open.
    assert arguments(events) == '{"text": "He said \\"hi\\"\\n'
    assert not p.finished


def test_long_string_argument_streams_piece_by_piece_without_waiting_for_the_close() -> None:
    p = processor()
    p.push(InferenceChunk.text(CALL_HEAD + PARAM_HEAD, 1))
    value = 'line one\n"quoted" \\ 数据 🦀 ' * 50
    streamed = ""
    for start in range(0, len(value), 7):
        piece = value[start : start + 7]
        events = p.push(InferenceChunk.text(piece, 1))
        if "<" not in piece:
            assert events, "a value piece with no marker candidate is released at once"
        streamed += arguments(events)
    assert json.loads('"' + streamed + '"') == value
    closing = p.push(InferenceChunk.text("</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n", 1))
    assert arguments(closing) == '"}'


def test_token_ids_ending_mid_character_wait_for_the_rest() -> None:
    crab = tokenizer().encode("🦀")
    assert len(crab) > 1
    p = processor()
    p.push(InferenceChunk.ready())
    assert p.push(InferenceChunk.tokens(crab[:1])) == []
    assert deltas(p.push(InferenceChunk.tokens(crab[1:]))) == [{"content": "🦀"}]


def test_marker_split_across_chunks_is_matched_and_earlier_text_released() -> None:
    p = processor(stage=ThinkingInitialStage.ReasoningStart)
    p.push(InferenceChunk.ready())
    assert deltas(p.push(InferenceChunk.text("plan</th", 1))) == []
    out = deltas(p.push(InferenceChunk.text("ink>answer", 1)))
    assert out == [
        {"content": None, "reasoning_content": "plan"},
        {"content": "answer", "reasoning_content": None},
    ]


def test_stop_sequence_split_across_chunks_ends_the_stream() -> None:
    p = processor(stop_sequences=["STOP"])
    p.push(InferenceChunk.ready())
    assert p.push(InferenceChunk.text("Hello ST", 1)) == []
    events = p.push(InferenceChunk.text("OP and more", 1))
    assert deltas(events)[0] == {"content": "Hello "}
    assert json.loads(events[-1].to_json())["choices"][0]["finish_reason"] == "stop"
    assert p.finished
    with pytest.raises(RuntimeError, match="stream processor has finished"):
        p.push(InferenceChunk.text("x", 1))
    assert p.finish() == []


def test_errors_close_the_processor() -> None:
    p = StreamProcessor(ChatCompletionChunkGenerator("id", "m", None), ParsingOptions())
    with pytest.raises(RuntimeError, match="token chunk received without a tokenizer"):
        p.push(InferenceChunk.tokens([5]))
    with pytest.raises(RuntimeError, match="stream processor is closed"):
        p.finish()
    assert not p.finished


def test_finish_chunk_reason_maps_to_tool_calls_after_a_call() -> None:
    p = processor()
    p.push(InferenceChunk.text(CALL_HEAD + "</｜DSML｜ invoke>\n</｜DSML｜ calls>", 3))
    final = json.loads(p.push(InferenceChunk.finish(InferenceFinishReason.Stop))[-1].to_json())
    assert final["choices"][0]["finish_reason"] == "tool_calls"
    assert final["usage"]["completion_tokens"] == 3


def test_tool_name_begun_in_token_chunk_keeps_added_token_spelling() -> None:
    p = processor()
    ids = tokenizer().encode(CALL_HEAD.removesuffix('write">\n') + "wr")
    p.push(InferenceChunk.tokens([*ids, 128805]))
    events = p.push(InferenceChunk.text('ite">\n'))
    name = deltas(events)[0]["tool_calls"][0]["function"]["name"]
    assert name == "wr<|EOT|>ite"


@pytest.mark.parametrize("first, second", [(True, False), (False, True)])
def test_ids_decoded_together_have_no_logprobs_unless_every_push_had_them(
    first: bool, second: bool
) -> None:
    p = processor(stage=ThinkingInitialStage.ReasoningStart)
    crab = tokenizer().encode("🦀")
    lp = (-0.5, [(5, -1.0)])
    p.push(InferenceChunk.tokens(crab[:1], [lp] if first else None))
    events = p.push(InferenceChunk.tokens(crab[1:], [lp] * (len(crab) - 1) if second else None))
    last = json.loads(events[-1].to_json())["choices"][0]
    assert last["delta"]["reasoning_content"] == "🦀"
    assert last["logprobs"] is None
