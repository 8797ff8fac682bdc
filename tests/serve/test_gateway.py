"""Gateway basics: per-API-key token accounting in /metrics (keys hashed) and the per-key
tokens-per-minute limit answered with 429 + Retry-After in each dialect's shape."""

from __future__ import annotations

import pytest
from test_api import CHAT_NO_THINKING, MESSAGES_BODY, anthropic_error, call, openai_error

from deepwell.recipe import InferenceChunk, InferenceFinishReason, PromptUsage
from deepwell.serve.api import create_app
from deepwell.serve.errors import ApiError
from deepwell.serve.gateway import Gateway, key_label
from deepwell.serve.settings import ServeSettings

KEYS = ("key-alpha", "key-beta")


async def fifty_tokens(request):
    """40 prompt tokens (16 from the cache) and 10 output tokens per request."""
    yield InferenceChunk.ready(
        prompt_usage=PromptUsage(prompt_tokens=40, prompt_cache_hit_tokens=16)
    )
    yield InferenceChunk.text("ten tokens", 10)
    yield InferenceChunk.finish(InferenceFinishReason.Stop)


def app(tokens_per_minute=None):
    settings = ServeSettings(api_keys=KEYS, key_tokens_per_minute=tokens_per_minute)
    return create_app(infer=fifty_tokens, settings=settings)


def chat(app, key, stream=False):
    body = {**CHAT_NO_THINKING, "stream": stream}
    return call(
        app, "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


def sample(metrics: str, name: str, key: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(f'{name}{{key="{key}"}}'))
    return float(line.split()[-1])


def test_tokens_are_accounted_per_hashed_key():
    served = app()
    for stream in (False, True):
        assert chat(served, KEYS[0], stream).status_code == 200
    assert chat(served, KEYS[1]).status_code == 200
    metrics = call(served, "GET", "/metrics").text
    alpha, beta = key_label(KEYS[0]), key_label(KEYS[1])
    assert sample(metrics, "deepwell_api_key_prompt_tokens_total", alpha) == 80
    assert sample(metrics, "deepwell_api_key_cached_tokens_total", alpha) == 32
    assert sample(metrics, "deepwell_api_key_completion_tokens_total", alpha) == 20
    assert sample(metrics, "deepwell_api_key_requests_total", beta) == 1
    assert KEYS[0] not in metrics and KEYS[1] not in metrics


def test_a_key_over_its_tokens_per_minute_gets_429_with_retry_after():
    served = app(tokens_per_minute=60)
    # 60 tokens of allowance: the first request leaves 10, the second goes 40 below zero.
    assert chat(served, KEYS[0]).status_code == 200
    assert chat(served, KEYS[0], stream=True).status_code == 200
    refused = chat(served, KEYS[0])
    error = openai_error(refused, 429)
    assert error["type"] == "rate_limit_error" and "60 tokens per minute" in error["message"]
    assert int(refused.headers["retry-after"]) in (40, 41)
    messages = call(
        served, "POST", "/v1/messages", json=MESSAGES_BODY, headers={"x-api-key": KEYS[0]}
    )
    assert anthropic_error(messages, 429)["type"] == "rate_limit_error"
    # Another key has its own allowance.
    assert chat(served, KEYS[1]).status_code == 200
    metrics = call(served, "GET", "/metrics").text
    assert sample(metrics, "deepwell_api_key_rate_limited_total", key_label(KEYS[0])) == 2


def test_the_allowance_refills_over_the_minute():
    now = [0.0]
    gateway = Gateway(tokens_per_minute=600, clock=lambda: now[0])
    gateway.admit("k")
    gateway.charge("k", prompt=900, cached=0, completion=0)
    with pytest.raises(ApiError) as refused:
        gateway.admit("k")
    # 301 tokens to regain at 10 per second.
    assert refused.value.status_code == 429 and refused.value.headers == {"Retry-After": "31"}
    now[0] = 31.0
    gateway.admit("k")
