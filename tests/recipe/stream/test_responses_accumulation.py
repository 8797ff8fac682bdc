"""ResponsesResponse mid-stream: the accumulated object shows each item as the events so far do.

Read off deepseek-recipe 0.2.0 (docs/recipe.md, "Responses accumulation").
"""

from __future__ import annotations

import json

from deepwell.recipe import (
    ConversionOptions,
    InferenceChunk,
    InferenceFinishReason,
    ParsingOptions,
    ResponsesRequest,
    ResponsesResponse,
    StreamProcessor,
    ThinkingInitialStage,
)


def accumulated_after_each_event(texts: list[str], finish: bool) -> list[tuple[str, dict]]:
    request = ResponsesRequest({"model": "DeepSeek-V4.1-Flash", "input": "x"}).convert(
        ConversionOptions()
    )
    generator = ResponsesRequest.chunk_generator(request, "r", "m")
    options = ParsingOptions(thinking_initial_stage=ThinkingInitialStage.ReasoningStart)
    processor = StreamProcessor(generator, options)
    events = []
    for text in texts:
        events += processor.push(InferenceChunk.text(text, 1))
    if finish:
        events += processor.push(InferenceChunk.finish(InferenceFinishReason.Length))
    response = ResponsesResponse("r", "m", 1, 0, 0)
    states = []
    for event in events:
        kind = event.type
        response.accumulate(event)
        states.append((kind, json.loads(response.to_json())))
    return states


def test_a_stream_cut_inside_a_message_shows_the_open_message_in_progress() -> None:
    kind, state = accumulated_after_each_event(["hi</think>hel", "lo"], finish=False)[-1]
    assert kind == "response.output_text.delta"
    assert state["status"] == "in_progress" and state["usage"] is None
    reasoning, message = state["output"]
    assert reasoning["status"] == "completed"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hi"}]
    assert message["status"] == "in_progress"
    assert message["content"][0]["text"] == "hello"


def test_an_item_turns_complete_only_with_its_output_item_done() -> None:
    states = accumulated_after_each_event(["hi"], finish=True)
    statuses = [(kind, state["output"][0]["status"]) for kind, state in states if state["output"]]
    assert statuses == [
        ("response.output_item.added", "in_progress"),
        ("response.content_part.added", "in_progress"),
        ("response.reasoning_text.delta", "in_progress"),
        ("response.reasoning_text.done", "in_progress"),
        ("response.content_part.done", "in_progress"),
        ("response.output_item.done", "incomplete"),
        ("response.incomplete", "incomplete"),
    ]
    added = states[2][1]["output"][0]
    assert added["content"] == []


def test_the_final_event_gives_the_whole_response() -> None:
    kind, state = accumulated_after_each_event(["hi</think>hello"], finish=True)[-1]
    assert kind == "response.incomplete"
    assert state["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["status"] for item in state["output"]] == ["completed", "incomplete"]
