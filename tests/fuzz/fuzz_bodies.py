"""Seeded mutations of valid request bodies over the five endpoint families: Chat
Completions, Responses, Messages, raw completions, and tokenize / detokenize.

Each case is the raw bytes sent (usually JSON, sometimes broken JSON) and the dialect whose
error shape any refusal must take. The same seed gives the same cases, so a failure found by
a long run replays in a short one.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any

OPENAI = "openai"
ANTHROPIC = "anthropic"


@dataclass(frozen=True)
class FuzzCase:
    path: str
    body: bytes
    # Which family's error shape a refusal must take.
    dialect: str
    # Whether the body asks for an SSE stream (when it parses as such).
    stream: bool
    # What was done to the valid body, for the report.
    mutation: str


def _valid_bodies(model: str) -> dict[str, dict[str, Any]]:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    return {
        "/v1/chat/completions": {
            "model": model,
            "max_tokens": 8,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello."},
            ],
            "tools": [tool],
            "temperature": 0.7,
        },
        "/v1/responses": {
            "model": model,
            "max_output_tokens": 8,
            "input": [{"role": "user", "content": "Say hello."}],
            "instructions": "Be brief.",
        },
        "/v1/messages": {
            "model": model,
            "max_tokens": 8,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
            "tools": [
                {
                    "name": "get_weather",
                    "description": "Weather for a city",
                    "input_schema": tool["function"]["parameters"],
                }
            ],
        },
        "/v1/completions": {"model": model, "max_tokens": 8, "prompt": "Once upon a time"},
        "/tokenize": {"model": model, "prompt": "Say hello."},
        "/detokenize": {"model": model, "tokens": [1, 2, 3]},
    }


# Values that stress parsers and type checks.
_ODD_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    1.5,
    -1e308,
    2**63,
    1e300,
    "",
    "x" * 5000,
    "\u0000",
    "\ud800",  # a lone surrogate: written as the escape \ud800 (see _dumps)
    "😀" * 10,
    "<|im_start|>",
    [],
    [None],
    {},
    {"type": "unknown"},
    [[[]]],
    "NaN",
]


def _dumps(value: Any) -> bytes:
    # ensure_ascii writes a lone surrogate as its escape, which is valid JSON text.
    return json.dumps(value, ensure_ascii=True).encode()


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside `value` (dict keys and list indices)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += _paths(inner, (*prefix, index))
    return found


def _set(body: Any, path: tuple, value: Any) -> None:
    for step in path[:-1]:
        body = body[step]
    body[path[-1]] = value


def _delete(body: Any, path: tuple) -> None:
    for step in path[:-1]:
        body = body[step]
    del body[path[-1]]


def _mutate(rng: random.Random, body: dict[str, Any]) -> tuple[bytes | None, str]:
    """One mutation of a copy of `body`: the bytes (None: send the dict as JSON) and a name."""
    kind = rng.choice(
        ["replace", "replace", "replace", "delete", "add", "wrap", "truncate", "raw", "none"]
    )
    paths = _paths(body)
    if kind == "replace" and paths:
        path = rng.choice(paths)
        value = copy.deepcopy(rng.choice(_ODD_VALUES))
        _set(body, path, value)
        return None, f"replace {'.'.join(map(str, path))} with {value!r:.40}"
    if kind == "delete" and paths:
        path = rng.choice(paths)
        _delete(body, path)
        return None, f"delete {'.'.join(map(str, path))}"
    if kind == "add":
        name = rng.choice(
            [
                "n",
                "logprobs",
                "top_logprobs",
                "seed",
                "stop",
                "tool_choice",
                "response_format",
                "stream_options",
                "logit_bias",
                "top_k",
                "metadata",
                "thinking",
                "reasoning",
                "unknown_field",
            ]
        )
        value = copy.deepcopy(rng.choice(_ODD_VALUES + [3, 20, {"type": "json_object"}]))
        body[name] = value
        return None, f"add {name}={value!r:.40}"
    if kind == "wrap":
        return _dumps(rng.choice([[body], "body", 42, None])), "not an object"
    if kind == "truncate":
        text = _dumps(body)
        return text[: rng.randrange(len(text))], "truncated JSON"
    if kind == "raw":
        return rng.choice([b"", b"{", b"\xff\xfe", b"{'single': 'quotes'}", b"[1,2,"]), "raw bytes"
    return None, "valid"


def fuzz_cases(seed: int, count: int, model: str) -> list[FuzzCase]:
    """`count` cases, round-robin over the endpoints, each mutated (or left valid) at random."""
    rng = random.Random(seed)
    valid = _valid_bodies(model)
    paths = list(valid)
    cases = []
    for index in range(count):
        path = paths[index % len(paths)]
        body = copy.deepcopy(valid[path])
        stream = path not in ("/tokenize", "/detokenize") and rng.random() < 0.5
        if stream:
            body["stream"] = True
        raw, mutation = _mutate(rng, body)
        if raw is None and rng.random() < 0.2:  # a second mutation
            raw, second = _mutate(rng, body)
            mutation += f"; {second}"
        data = raw if raw is not None else _dumps(body)
        dialect = ANTHROPIC if path == "/v1/messages" else OPENAI
        cases.append(FuzzCase(path, data, dialect, stream and raw is None, mutation))
    return cases
