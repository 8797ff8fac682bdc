"""Parallel samples of one prompt: Chat Completions' `n` > 1 as one response, and the seeds
and start order `/v1/completions` shares for its `n` and `best_of` (completions.py).

Each sample is its own engine request with its own seed (the request's seed + its index, so
seeded samples repeat and differ from each other). The first sample starts alone; the others
start once it has read the prompt, so they find the prompt's full KV blocks in the prefix
cache and share them instead of computing and holding the prompt n times (each recomputes
only the prompt's last, partial block).

The samples' chunks are the recipe's, with the choice index set to the sample's; the usage
comes once, on the last final chunk (or the response): the prompt counted once, the
completions summed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from deepwell.engine.sampling_params import SamplingParams
from deepwell.recipe.dialects.json_text import parse_json_text
from deepwell.serve.errors import ApiError
from deepwell.serve.sampling_fields import SEED_LIMIT

# The recipe writes every chat chunk's choice as this, first in its `choices`.
_FIRST_CHOICE = '"choices":[{"index":0,'
_DONE = object()
# OpenAI's bound on `n`.
MAX_SAMPLES = 128


def requested_samples(body: bytes) -> tuple[int, bytes]:
    """A Chat Completions body's `n`, and the body the recipe converts: without `n`, which
    DeepSeek's conversion refuses beyond 1. A body that does not parse is the recipe's to
    refuse, in its words."""
    if b'"n"' not in body:
        return 1, body
    try:
        data = parse_json_text(body)
    except ValueError:
        return 1, body
    if not isinstance(data, dict) or data.get("n") in (None, 1):
        return 1, body
    n = data["n"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise ApiError(
            400, f"Invalid 'n': an integer in [1, {MAX_SAMPLES}], got {json.dumps(n)}", param="n"
        )
    del data["n"]
    return n, json.dumps(data, ensure_ascii=False).encode()


def sample_seeds(seed: int, n: int) -> list[int]:
    return [(seed + index) % SEED_LIMIT for index in range(n)]


def sample_samplings(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """Each of n samples' sampling: the request's, with the sample's own seed."""
    return [replace(sampling, seed=seed, seq_seed=seed) for seed in sample_seeds(sampling.seed, n)]


def samples_of(prepared: Any, n: int, new_generator: Callable[[], object]) -> list[Any]:
    """The n samples of a prepared request: the same prompt and response id, each with its
    own engine request id, seed and chunk generator."""
    inference = prepared.inference
    samplings = sample_samplings(inference.sampling, n)
    return [
        replace(
            prepared,
            generator=prepared.generator if index == 0 else new_generator(),
            inference=replace(
                inference,
                request_id=f"{inference.request_id}-{index}",
                sampling=samplings[index],
            ),
        )
        for index in range(n)
    ]


async def interleaved(
    streams: list[Callable[[], AsyncIterator[Any]]], group: int | None = None
) -> AsyncIterator[tuple[int, Any]]:
    """(sample index, item) of every sample's stream as they come; sample 0 starts alone and
    the rest once it has produced its first item. Closing this closes them all.

    `group`: the streams are the samples of several prompts, `group` consecutive ones each;
    each prompt's first sample starts at once, its others once it has produced an item.
    """
    queue: asyncio.Queue = asyncio.Queue()
    size = group or len(streams)
    first_items = [asyncio.Event() for _ in range(0, len(streams), size)]

    async def pump(index: int) -> None:
        first_item = first_items[index // size]
        if index % size:
            await first_item.wait()
        items = streams[index]()
        try:
            async for item in items:
                await queue.put((index, item))
                first_item.set()
        except Exception as error:  # handed to the consumer, which raises it
            await queue.put((index, error))
        finally:
            await items.aclose()
            first_item.set()
            await queue.put((index, _DONE))

    tasks = [asyncio.ensure_future(pump(index)) for index in range(len(streams))]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ChunkIndexer:
    """Sets each chunk's choice index to its sample's, and moves the usage to the last
    final chunk, summed."""

    def __init__(self, n: int) -> None:
        self.unfinished = n
        self.usages: list[dict[str, Any]] = []

    def chunk(self, index: int, text: str) -> str:
        text = text.replace(_FIRST_CHOICE, f'"choices":[{{"index":{index},', 1)
        if '"usage":{' not in text:
            return text
        chunk = json.loads(text)
        self.usages.append(chunk["usage"])
        self.unfinished -= 1
        chunk["usage"] = merged_usage(self.usages) if self.unfinished == 0 else None
        return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))


def merged_response(responses: list[str]) -> str:
    """One chat completion of the samples' own: their choices, indexed, and one usage."""
    objects = [json.loads(text) for text in responses]
    merged = objects[0]
    merged["choices"] = [dict(o["choices"][0], index=i) for i, o in enumerate(objects)]
    merged["usage"] = merged_usage([o["usage"] for o in objects])
    return json.dumps(merged, ensure_ascii=False, separators=(",", ":"))


def merged_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The first sample's prompt (the one that read it) and every sample's completion."""
    merged = dict(usages[0])
    completion = sum(usage["completion_tokens"] for usage in usages)
    merged["completion_tokens"] = completion
    merged["total_tokens"] = merged["prompt_tokens"] + completion
    if "completion_tokens_details" in merged:
        reasoning = sum(
            (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
            for usage in usages
        )
        merged["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return merged
