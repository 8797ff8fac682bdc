"""StreamProcessor throughput: 10,000 text chunks per dialect, deepwell against deepseek_recipe.

The workload of spec/bench_reference.py (b): thinking mode, `</think>` halfway, ready and
finish around it. Both sides run in this process on the same chunks; their events are checked
equal first. Prints per-chunk medians for `push` only and `push` + `to_json()`, and the ratio.

    .venv/bin/python benchmarks/recipe_stream.py [--runs 9]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import deepseek_recipe as ref

import deepwell.recipe as ours

CHUNKS = 10_000
PIECES = ["Hel", "lo", " 世界", "，", "ok", " ", "\n", "数据", "ab", "c."]
BODIES = {
    "chat": ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}]}),
    "responses": ("ResponsesRequest", {"input": "x"}),
    "messages": (
        "MessagesRequest",
        {"max_tokens": 100, "messages": [{"role": "user", "content": "x"}]},
    ),
}


def texts() -> list[str]:
    rnd = random.Random(7)
    out = [rnd.choice(PIECES) for _ in range(CHUNKS)]
    out[CHUNKS // 2] = "</think>"
    return out


def stream(lib: object, dialect: str, chunks: list[str], to_json: bool) -> Callable[[], int]:
    class_name, body = BODIES[dialect]
    request_class = getattr(lib, class_name)

    def once() -> int:
        converted = request_class({"model": "DeepSeek-V4.1-Flash", **body}).convert(
            lib.ConversionOptions()
        )
        generator = request_class.chunk_generator(converted, "id-1", "m")
        processor = lib.StreamProcessor(generator, converted.parsing_options)
        text = lib.InferenceChunk.text
        n = 0
        events = processor.push(
            lib.InferenceChunk.ready(prompt_usage=lib.PromptUsage(prompt_tokens=5))
        )
        for t in chunks:
            events += processor.push(text(t, 1))
        events += processor.push(lib.InferenceChunk.finish(lib.InferenceFinishReason.Stop))
        events += processor.finish()
        if to_json:
            for e in events:
                n += len(e.to_json())
        processor.close()
        return len(events) if not to_json else n

    return once


def events_json(lib: object, dialect: str, chunks: list[str]) -> list[dict]:
    class_name, body = BODIES[dialect]
    request_class = getattr(lib, class_name)
    converted = request_class({"model": "DeepSeek-V4.1-Flash", **body}).convert(
        lib.ConversionOptions()
    )
    processor = lib.StreamProcessor(
        request_class.chunk_generator(converted, "id-1", "m"), converted.parsing_options
    )
    out = []
    for t in chunks:
        out += [json.loads(e.to_json()) for e in processor.push(lib.InferenceChunk.text(t, 1))]
    out += [json.loads(e.to_json()) for e in processor.finish()]
    for event in out:
        for key in ("created", "created_at", "completed_at"):
            event.pop(key, None)
            if isinstance(event.get("response"), dict):
                event["response"].pop(key, None)
    return out


def median_seconds(fn: Callable[[], int], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    chunks = texts()
    print(f"{CHUNKS} text chunks per stream, median of {args.runs} runs, µs per chunk")
    print(f"{'dialect':<10} {'measure':<16} {'deepwell':>9} {'reference':>10} {'ratio':>6}")
    for dialect in BODIES:
        if events_json(ours, dialect, chunks) != events_json(ref, dialect, chunks):
            raise SystemExit(f"{dialect}: deepwell and the reference disagree on the events")
        for label, to_json in (("push", False), ("push + to_json", True)):
            mine = median_seconds(stream(ours, dialect, chunks, to_json), args.runs)
            theirs = median_seconds(stream(ref, dialect, chunks, to_json), args.runs)
            print(
                f"{dialect:<10} {label:<16} {mine / CHUNKS * 1e6:>9.2f} "
                f"{theirs / CHUNKS * 1e6:>10.2f} {mine / theirs:>6.2f}"
            )


if __name__ == "__main__":
    main()
