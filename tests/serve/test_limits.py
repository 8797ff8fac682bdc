"""Bounded and timed: a full queue answers 503 with Retry-After in the dialect's shape, and a
request past its deadline is stopped, its KV blocks freed even while its reader sleeps."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from servers import MODEL_ARGS, start_server

TIMEOUT_S = 3


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("limits"),
        *MODEL_ARGS,
        "--threads",
        "1",
        "--request-timeout",
        str(TIMEOUT_S),
        "--max-waiting-requests",
        "1",
    )
    yield server
    assert server.stop() == 0


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_slow_sse_reader_holds_no_blocks_past_the_deadline(limited_server):
    base, model = limited_server.base_url, limited_server.model
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    expired_before = metric(base, "deepwell_deadline_expiries_total")
    with (
        httpx.Client(base_url=base, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        # The client stops reading; the deadline must still free the request's blocks.
        deadline = time.monotonic() + TIMEOUT_S + 30
        while metric(base, "deepwell_deadline_expiries_total") == expired_before:
            assert time.monotonic() < deadline, "the deadline never fired"
            time.sleep(0.2)
        while metric(base, "deepwell_kv_blocks_used"):
            assert time.monotonic() < deadline, "KV blocks still held past the deadline"
            time.sleep(0.2)
        data = [line[6:] for line in lines if line.startswith("data: ")]
    error = json.loads(next(d for d in data if '"error"' in d))["error"]
    assert error["type"] == "timeout_error"
    assert "deadline" in error["message"]


def test_request_past_its_deadline_answers_408_in_the_anthropic_shape(limited_server):
    base, model = limited_server.base_url, limited_server.model
    body = {
        "model": model,
        "max_tokens": 4000,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "ignore_eos": True,
    }
    started = time.monotonic()
    response = httpx.post(f"{base}/v1/messages", json=body, timeout=60)
    assert response.status_code == 408
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "timeout_error"
    assert time.monotonic() - started < TIMEOUT_S + 10


def test_full_queue_answers_503_with_retry_after(limited_server):
    base, model = limited_server.base_url, limited_server.model
    # A long prompt keeps the first request waiting for its first token a while.
    long_prompt = " ".join(f"word{index}" for index in range(1500))
    first = {"model": model, "max_tokens": 1, "prompt": long_prompt}
    answers = []
    sender = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{base}/v1/completions", json=first, timeout=60))
    )
    rejected_before = metric(base, "deepwell_queue_rejections_total")
    sender.start()
    try:
        deadline = time.monotonic() + 10
        while not metric(base, "deepwell_requests_waiting") + metric(
            base, "deepwell_requests_running"
        ):
            assert time.monotonic() < deadline, "the first request never reached the engine"
            time.sleep(0.02)
        chat = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        )
        messages = httpx.post(
            f"{base}/v1/messages",
            json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
    finally:
        sender.join()
    assert chat.status_code == 503, chat.text
    assert chat.headers["retry-after"] == "1"
    assert chat.json()["error"]["type"] == "service_unavailable"
    assert "queue is full" in chat.json()["error"]["message"]
    assert messages.status_code == 503
    assert messages.json()["error"]["type"] == "overloaded_error"
    assert metric(base, "deepwell_queue_rejections_total") == rejected_before + 2
    assert answers[0].status_code in (200, 408)
