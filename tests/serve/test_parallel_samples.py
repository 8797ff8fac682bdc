"""Chat Completions `n` > 1: n samples of one prompt, their choices indexed as OpenAI indexes
them, the prompt's KV blocks shared through the prefix cache (seeded repeats: test_seed.py)."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import httpx
import openai
import pytest

from deepwell.serve.api import create_app
from tests.serve.test_errors import MODEL, sdk_clients

SAMPLED = {"temperature": 1.0, "max_tokens": 24, "seed": 7}
HITS = "deepwell_prefix_cache_hit_tokens_total"
BLOCK_SIZE = 128  # --block-size's default


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def test_samples_share_the_prompts_kv_blocks(model_server):
    client = openai.OpenAI(base_url=f"{model_server.base_url}/v1", api_key="unused", max_retries=0)
    # A prompt no earlier test sent, so the first sample finds nothing cached.
    # Long enough for three full KV blocks of 128 tokens.
    prompt = f"Tell me a short fact about the number {uuid.uuid4().int % 10**12}. " * 40
    messages = [{"role": "user", "content": prompt}]
    hits_before = metric(model_server.base_url, HITS)
    first = client.chat.completions.create(
        model=model_server.model, messages=messages, n=3, **SAMPLED
    )
    # Samples 1 and 2 read the prompt's full blocks from the cache (counted as they arrive
    # with the workers' heartbeats).
    full_blocks = first.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    deadline = time.monotonic() + 10
    gained = 0.0
    while gained < 2 * full_blocks and time.monotonic() < deadline:
        time.sleep(0.2)
        gained = metric(model_server.base_url, HITS) - hits_before
    assert gained == 2 * full_blocks > 0

    assert [choice.index for choice in first.choices] == [0, 1, 2]


def test_n_indexes_choices_and_counts_the_usage_once_in_process():
    openai_client, _ = sdk_clients(create_app())
    messages = [{"role": "user", "content": "Hi"}]

    async def run():
        whole = await openai_client.chat.completions.create(model=MODEL, messages=messages, n=3)
        single = await openai_client.chat.completions.create(model=MODEL, messages=messages)
        stream = await openai_client.chat.completions.create(
            model=MODEL, messages=messages, n=2, stream=True
        )
        chunks = [chunk async for chunk in stream]
        with pytest.raises(openai.BadRequestError) as refused:
            await openai_client.chat.completions.create(model=MODEL, messages=messages, n=0)
        return whole, single, chunks, refused.value

    whole, single, chunks, refused = asyncio.run(run())
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert {choice.index for chunk in chunks for choice in chunk.choices} == {0, 1}
    assert [chunk.usage is not None for chunk in chunks].count(True) == 1
    assert refused.body["param"] == "n"
