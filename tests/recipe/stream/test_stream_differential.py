"""Differential test against deepseek-recipe 0.2.0: same random model output, same events.

Outputs mix reasoning, content, DSML tool calls (V4 and V4.1 markup) with hostile string
arguments, JSON mode and stop sequences; they are cut at random places (at and across
`</think>`) into text chunks, token chunks or a mix of both, and may stop mid-part. Chat
requests vary `stream` and `stream_options.include_usage`. The parsing options are built
directly: mostly in the request's own thinking mode, but also apart from it, and the request
itself is sometimes built directly from a conversation rather than converted from a body.
Every push, the finish call, the usage, and the accumulated response after every event must
agree.
"""

from __future__ import annotations

import json
import random

import deepseek_recipe as dr
import pytest
from stream_cases import TOKENIZER_PATH, normalize, tokenizer

import deepwell.recipe as ours

REQUEST_CLASSES = {
    "chat": ("ChatCompletionRequest", "ChatCompletionResponse"),
    "responses": ("ResponsesRequest", "ResponsesResponse"),
    "messages": ("MessagesRequest", "MessagesResponse"),
}
RAW_VALUES = [
    "3",
    "[1, 2]",
    '{"k": null}',
    "true",
    "1.50",
    "-0.0",
    "1e400",
    "not json",
    "12345678901234567890123",
]
STAGES = [None, "ReasoningStart", "ReasoningContinuation", "ContentContinuation"]
# Chat `stream` / `stream_options` variants: absent, streaming without options, include_usage.
STREAM_FLAGS = [None, False, True, (True, None), (True, True), (True, False)]
STOPS = ["STOP", "\n\n", "end.", "世界", "}", "</", 'a"b', "fim", "think>"]
# Added tokens a model may emit besides the markers: BOS, EOS, <think>, fim, EOT, a placeholder.
ADDED_IDS = [0, 1, 128821, 128800, 128805, 128000]
WORDS = [
    "hello",
    " world",
    "数据",
    "模型",
    "\n",
    "\n\n",
    " ",
    '"',
    "\\",
    "{",
    "[",
    "```",
    "`",
    "<",
    "</",
    "</th",
    "think>",
    "<｜DSML",
    "｜",
    ">",
    "STOP",
    "end.",
    "世界",
    "é",
    "🦀",
    "\t",
    'a"b',
    "x",
    "42",
]


@pytest.fixture(scope="module")
def reference_tokenizer() -> dr.Tokenizer:
    return dr.Tokenizer.from_file(str(TOKENIZER_PATH))


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(n))


def string_argument(rng: random.Random) -> str:
    pieces = ["Paris", ' "Île"', "\\n", "\\", "\n", "数据库", "'", "🦀", "tab\t", "}", '{"a": 1}']
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))


def tool_calls(rng: random.Random, v41: bool) -> str:
    sep = " " if v41 else ""
    calls = [f"<｜DSML｜{sep}{'calls' if v41 else 'tool_calls'}>\n"]
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(["get_weather", "noop", "fs::read", "apply_patch", "search"])
        calls.append(f'<｜DSML｜{sep}invoke name="{name}">\n')
        for _ in range(rng.randint(0, 3)):
            key = rng.choice(["city", "days", "input", "query", "two words"])
            if rng.random() < 0.6:
                calls.append(
                    f'<｜DSML｜{sep}parameter name="{key}" string="true">{string_argument(rng)}</｜DSML｜{sep}parameter>\n'
                )
            else:
                raw = rng.choice(RAW_VALUES)
                calls.append(
                    f'<｜DSML｜{sep}parameter name="{key}" string="false">{raw}</｜DSML｜{sep}parameter>\n'
                )
        calls.append(f"</｜DSML｜{sep}invoke>\n")
    calls.append(f"</｜DSML｜{sep}{'calls' if v41 else 'tool_calls'}>")
    return "".join(calls)


def model_output(rng: random.Random, options: dict) -> str:
    parts = []
    if options["stage"] in ("ReasoningStart", "ReasoningContinuation"):
        parts += [
            rng.choice(["", "\n", "\n\n"]),
            random_text(rng, rng.randint(0, 30)),
            rng.choice(["</think>", "\n\n</think>", ""]),
        ]
    parts.append(rng.choice(["", "\n\n", "\n"]))
    if options["json"] and rng.random() < 0.7:
        parts += [
            random_text(rng, rng.randint(0, 5)),
            rng.choice(["```json\n", "```\n", ""]),
            json.dumps({"k": string_argument(rng), "n": [1, 2]}, ensure_ascii=False),
            rng.choice(["\n```", ""]),
        ]
    parts.append(random_text(rng, rng.randint(0, 30)))
    if options["tools"] and rng.random() < 0.8:
        parts += [rng.choice(["", "\n\n", "\n"]), tool_calls(rng, rng.random() < 0.5)]
    parts.append(random_text(rng, rng.randint(0, 5)))
    return "".join(parts)


def cut(rng: random.Random, n: int) -> list[int]:
    points = (
        sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, max(1, n // 3))))) if n > 1 else []
    )
    if rng.random() < 0.3:
        points += [rng.randint(0, n) for _ in range(rng.randint(1, 3))]
    return sorted(points)


def token_chunks(rng: random.Random, text: str) -> list[tuple]:
    ids = tokenizer().encode(text)
    for _ in range(rng.randint(0, 3) if rng.random() < 0.3 else 0):
        ids.insert(rng.randint(0, len(ids)), rng.choice(ADDED_IDS))
    if rng.random() < 0.3:
        # Cut short, as max_tokens does: the stream may end inside any part.
        ids = ids[: rng.randint(0, len(ids))]
    bounds = [0, *cut(rng, len(ids)), len(ids)]
    # Log probabilities with every chunk, with none, or with some (a character split across
    # chunks then has them on one side only).
    share = rng.choice([0.0, 1.0, 0.5])
    chunks = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece = ids[a:b]
        logprobs = (
            [(-rng.random() * 5, [(rng.choice(ids or [5]), -rng.random() * 9)]) for _ in piece]
            if rng.random() < share
            else None
        )
        chunks.append(("tokens", piece, logprobs))
    return chunks


def text_chunks(rng: random.Random, text: str) -> list[tuple]:
    if rng.random() < 0.3:
        text = text[: rng.randint(0, len(text))]
    bounds = [0, *cut(rng, len(text)), len(text)]
    return [
        ("text", text[a:b], rng.randint(0, 3)) for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def mixed_chunks(rng: random.Random, text: str) -> list[tuple]:
    """Text and token chunks in turn, cut at random characters (inside `</think>` too)."""
    bounds = [0, *cut(rng, len(text)), len(text)]
    if rng.random() < 0.3:
        bounds = bounds[: rng.randint(1, len(bounds))]
    chunks: list[tuple] = []
    as_text = rng.random() < 0.5
    for a, b in zip(bounds, bounds[1:], strict=False):
        # Known divergence (docs/recipe.md, open points): a `<` still pending as a possible
        # marker when the chunk kind switches. The kind stays the same there.
        if "<" not in text[max(0, a - 10) : a]:
            as_text = rng.random() < 0.5
        if as_text:
            chunks.append(("text", text[a:b], rng.randint(0, 3)))
        else:
            chunks += token_chunks(rng, text[a:b])
    return chunks


def example(seed: int) -> dict:
    rng = random.Random(seed)
    options = {
        "stage": rng.choice(STAGES),
        "tools": rng.random() < 0.6,
        "json": rng.random() < 0.25,
        "in_calls": rng.random() < 0.05,
        "stops": rng.sample(STOPS, rng.randint(0, 2)) if rng.random() < 0.4 else [],
        "stream": rng.choice(STREAM_FLAGS),
    }
    text = model_output(rng, options)
    mode = rng.choice(["text", "tokens", "mixed"])
    chunks: list[tuple] = []
    if rng.random() < 0.7:
        chunks.append(("ready", rng.randint(0, 50), rng.randint(0, 5), rng.choice([None, "fp"])))
    if mode == "tokens":
        chunks += token_chunks(rng, text)
    elif mode == "text":
        chunks += text_chunks(rng, text)
    else:
        chunks += mixed_chunks(rng, text)
    if rng.random() < 0.8:
        chunks.append(("finish", rng.choice(["Stop", "Stop", "Length", "ContentFilter"])))
    # The request the generator comes from: converted in the parsing options' thinking mode,
    # converted in a mode drawn apart from them, or built directly from a conversation
    # (whose parsing options start in no stage, whatever its thinking mode).
    origin = rng.choice(["same", "same", "apart", "direct"])
    options["request_stage"] = rng.choice(STAGES) if origin != "same" else options["stage"]
    options["direct"] = origin == "direct"
    return {
        "options": options,
        "chunks": chunks,
        # A tokenizer alone (text chunks only) still decides whether reasoning is counted.
        "tokenizer": mode != "text" or rng.random() < 0.5,
        "dialect": rng.choice(list(REQUEST_CLASSES)),
    }


def body(dialect: str, options: dict) -> dict:
    thinking = options["request_stage"] is not None
    if dialect == "chat":
        b = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "x"}]}
        if not thinking:
            b["thinking"] = {"type": "disabled"}
        stream = options["stream"]
        if isinstance(stream, tuple):
            b["stream"] = stream[0]
            b["stream_options"] = {"include_usage": stream[1]}
        elif stream is not None:
            b["stream"] = stream
    elif dialect == "responses":
        b = {
            "model": "DeepSeek-V4.1-Flash",
            "input": "x",
            "tools": [
                {
                    "type": "namespace",
                    "name": "fs",
                    "description": "d",
                    "tools": [{"type": "function", "name": "read"}],
                },
                {"type": "custom", "name": "apply_patch"},
            ],
        }
        if not thinking:
            b["reasoning"] = {"effort": "none"}
    else:
        b = {
            "model": "DeepSeek-V4.1-Flash",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "x"}],
        }
        if not thinking:
            b["thinking"] = {"type": "disabled"}
    return b


def run(lib: object, ex: dict, tokenizer_for_side: object) -> list:
    """Drive `lib` (deepwell.recipe or deepseek_recipe) over one example; the normalised record."""
    dialect = ex["dialect"]
    request_name, response_name = REQUEST_CLASSES[dialect]
    request_class = getattr(lib, request_name)
    o = ex["options"]
    if o["direct"]:
        conversation = lib.Conversation(
            [lib.UserMessage("x")], thinking_mode=o["request_stage"] is not None
        )
        converted = lib.ConversationRequest(conversation, lib.ModelVersion.DeepseekV41Flash)
    else:
        converted = request_class(body(dialect, o)).convert(lib.ConversionOptions())
    generator = request_class.chunk_generator(converted, "resp-1", "m")
    parsing = lib.ParsingOptions(
        parse_tool_calls=o["tools"],
        starts_in_tool_calls=o["in_calls"],
        parse_json_output=o["json"],
        thinking_initial_stage=None
        if o["stage"] is None
        else getattr(lib.ThinkingInitialStage, o["stage"]),
        stop_sequences=o["stops"],
    )
    processor = lib.StreamProcessor(
        generator, parsing, tokenizer_for_side if ex["tokenizer"] else None
    )
    response = getattr(lib, response_name)("resp-1", "m", 1700000000, 0, 0)
    record = []
    for spec in ex["chunks"]:
        if processor.finished:
            break
        kind = spec[0]
        if kind == "ready":
            usage = lib.PromptUsage(prompt_tokens=spec[1], prompt_cache_hit_tokens=spec[2])
            chunk = lib.InferenceChunk.ready(prompt_usage=usage, system_fingerprint=spec[3])
        elif kind == "text":
            chunk = lib.InferenceChunk.text(spec[1], spec[2])
        elif kind == "tokens":
            chunk = lib.InferenceChunk.tokens(spec[1], spec[2])
        else:
            chunk = lib.InferenceChunk.finish(getattr(lib.InferenceFinishReason, spec[1]))
        record += events(processor.push(chunk), response)
    record += events(processor.finish(), response)
    record.append(normalize(json.loads(response.to_json())))
    return record


def events(outs: list, response: object) -> list:
    """Each event, and the accumulated response after it (a stream may be cut anywhere)."""
    record = []
    for e in outs:
        record.append(normalize(json.loads(e.to_json())))
        response.accumulate(e)
        record.append(normalize(json.loads(response.to_json())))
    return record


def check(seed: int, reference_tokenizer: dr.Tokenizer) -> None:
    ex = example(seed)
    expected = run(dr, ex, reference_tokenizer)
    got = run(ours, ex, tokenizer())
    assert got == expected, (seed, ex)


@pytest.mark.parametrize("seed", range(60))
def test_same_events_as_reference(seed: int, reference_tokenizer: dr.Tokenizer) -> None:
    check(seed, reference_tokenizer)


@pytest.mark.slow
def test_same_events_as_reference_5000(reference_tokenizer: dr.Tokenizer) -> None:
    for seed in range(1000, 6000):
        check(seed, reference_tokenizer)
