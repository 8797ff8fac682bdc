"""Clients that leave mid-stream abort their requests and give their KV blocks back."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx

CLIENTS = 50


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def test_fifty_clients_leaving_at_random_points_leave_no_blocks_held(model_server):
    base = model_server.base_url
    model = model_server.model
    rng = random.Random(5)
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Count to 100."}]},
        "/v1/responses": {"input": "Count to 100."},
        "/v1/messages": {"messages": [{"role": "user", "content": "Count to 100."}]},
    }
    limits = {"/v1/responses": "max_output_tokens"}

    async def leave_after(path: str, frames: int) -> int:
        body = {**bodies[path], "model": model, "stream": True, limits.get(path, "max_tokens"): 512}
        seen = 0
        async with (
            httpx.AsyncClient(base_url=base, timeout=300) as http,
            http.stream("POST", path, json=body) as response,
        ):
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if seen >= frames:
                    break
                seen += line.startswith("data: ")
        return seen

    async def run() -> list[int]:
        paths = list(bodies)
        return await asyncio.gather(
            *(leave_after(rng.choice(paths), rng.randint(0, 6)) for _ in range(CLIENTS))
        )

    asyncio.run(run())
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{base}/metrics").text
        held = metric(text, "deepwell_kv_blocks_used")
        busy = metric(text, "deepwell_requests_running") + metric(text, "deepwell_requests_waiting")
        if held == 0 and busy == 0:
            break
        assert time.monotonic() < deadline, f"{held} KV blocks still held, {busy} requests"
        time.sleep(0.1)
    assert metric(text, "deepwell_kv_blocks_total") > 0
    answer = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] >= 1
