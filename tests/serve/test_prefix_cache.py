"""A multi-turn conversation through `deepwell serve`: the second turn's answer is the same
with a memory hit, with a KV store hit from a fresh server, and with no cache at all."""

from __future__ import annotations

import re

import httpx
import pytest
from servers import MODEL_ARGS, start_server

SYSTEM = (
    "You are a patient tutor. Answer in one short sentence, in plain words, without lists. "
    "The student is learning geography and likes capitals, rivers and mountains."
)
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is Paris?"}]
# Small blocks, so a short conversation spans several of them.
CACHE_ARGS = (*MODEL_ARGS, "--block-size", "16")


def chat(server, messages: list[dict], cache_class: str = "chat") -> tuple[str, int]:
    """Greedy answer and the prompt tokens served from the cache."""
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": server.model, "messages": messages, "max_tokens": 24, "temperature": 0},
        headers={"x-deepwell-cache-class": cache_class},
        timeout=300,
    )
    response.raise_for_status()
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_cache_hit_tokens"]


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.mark.slow  # three server starts
def test_second_turn_is_the_same_from_memory_store_and_no_cache(tmp_path):
    store = str(tmp_path / "kv")
    first = start_server(tmp_path, *CACHE_ARGS, "--kv-store", store)
    try:
        answer, cached = chat(first, FIRST, "agent")
        assert cached == 0
        second = [*FIRST, {"role": "assistant", "content": answer}]
        second.append({"role": "user", "content": "And what river runs through it?"})
        from_memory, memory_hit = chat(first, second)
        assert memory_hit > 0
        assert metric(first, "deepwell_prefix_cache_hit_tokens_total") >= memory_hit
        assert metric(first, "deepwell_kv_store_written_bytes_total") > 0
    finally:
        assert first.stop() == 0  # a clean stop writes out the store's queue

    fresh = start_server(tmp_path, *CACHE_ARGS, "--kv-store", store)
    try:
        from_store, store_hit = chat(fresh, second)
        # The first server also stored the second turn's own prompt blocks.
        assert store_hit >= memory_hit
        assert metric(fresh, "deepwell_kv_store_hits_total") == store_hit // 16
        assert metric(fresh, "deepwell_kv_store_errors_total") == 0
    finally:
        assert fresh.stop() == 0

    uncached = start_server(tmp_path, *CACHE_ARGS, "--no-prefix-caching")
    try:
        from_scratch, no_hit = chat(uncached, second)
        assert no_hit == 0
    finally:
        assert uncached.stop() == 0
    assert from_memory == from_store == from_scratch


def test_an_unknown_cache_class_is_a_400(model_server):
    response = httpx.post(
        f"{model_server.base_url}/v1/chat/completions",
        json={"model": model_server.model, "messages": FIRST, "max_tokens": 4},
        headers={"x-deepwell-cache-class": "batch"},
    )
    assert response.status_code == 400
    assert "x-deepwell-cache-class" in response.json()["error"]["message"]
