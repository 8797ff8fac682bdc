"""Accumulated responses mid-stream: each shows its items as the events so far describe them.

Read off deepseek-recipe 0.2.0 (docs/recipe.md, "Stream usage and accumulation").
"""

from __future__ import annotations

import json

from deepwell.recipe import (
    ConversionOptions,
    InferenceChunk,
    InferenceFinishReason,
    MessagesRequest,
    MessagesResponse,
    ParsingOptions,
    PromptUsage,
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


CALL = (
    '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
    '<｜DSML｜ parameter name="a" string="true">v</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
)


def messages_after_each_event(texts: list[str]) -> list[tuple[str, dict]]:
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "max_tokens": 9,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    request = MessagesRequest(body).convert(ConversionOptions())
    generator = MessagesRequest.chunk_generator(request, "r", "m")
    processor = StreamProcessor(generator, request.parsing_options)
    usage = PromptUsage(prompt_tokens=9, prompt_cache_hit_tokens=2)
    events = processor.push(InferenceChunk.ready(prompt_usage=usage))
    for text in texts:
        events += processor.push(InferenceChunk.text(text, 1))
    events += processor.push(InferenceChunk.finish(InferenceFinishReason.Length))
    response = MessagesResponse("r", "m", 1, 0, 0)
    states = []
    for event in events:
        kind = event.type
        response.accumulate(event)
        states.append((kind, json.loads(response.to_json())))
    return states


def test_messages_usage_comes_from_message_start() -> None:
    kind, state = messages_after_each_event(["hi"])[0]
    assert kind == "message_start"
    assert state["usage"]["input_tokens"] == 7 and state["usage"]["cache_read_input_tokens"] == 2


def test_messages_blocks_show_only_accumulated_deltas() -> None:
    states = messages_after_each_event(["hi", "ho</think>yo"])
    thinking = [s["content"][0] for kind, s in states if kind == "content_block_delta"]
    assert thinking[:3] == [
        {"type": "thinking", "thinking": "hi", "signature": ""},
        {"type": "thinking", "thinking": "hiho", "signature": ""},
        {"type": "thinking", "thinking": "hiho", "signature": "r"},
    ]


def test_messages_tool_input_is_parsed_when_its_block_stops() -> None:
    states = messages_after_each_event(["hi</think>", CALL, '<｜DSML｜ invoke name="f">\n'])
    inputs = [(kind, s["content"][-1].get("input")) for kind, s in states if s["content"]]
    first_stop = next(i for i, (kind, value) in enumerate(inputs) if value == {"a": "v"})
    assert inputs[first_stop][0] == "content_block_stop"
    assert all(value == {} for _, value in inputs[first_stop - 7 : first_stop])
    # The second call is cut by max_tokens: its input stays empty.
    assert inputs[-1] == ("message_stop", {})
