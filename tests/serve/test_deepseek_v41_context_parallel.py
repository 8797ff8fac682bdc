"""`deepwell serve --context-parallel-size 2` on the tiny DeepSeek-V4.1, driven with the
official OpenAI SDK: a long prompt's reply is the one a single-process server gives, and
stopping the server leaves no rank behind."""

from __future__ import annotations

import time

import openai
import pytest
from servers import V41_ARGS, children_of, is_running, start_server, write_v41_checkpoint

pytestmark = pytest.mark.slow

# Exact comparisons: float32 and caches in float32 on both servers.
EXACT = ("--dtype", "float32", "--no-kv-cache-quantization")
# Well past the 16-token threshold (twice the tiny model's window) once rendered.
PROMPT = "Tell me everything about the weather in Paris, Rome and Oslo this week. " * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41_cp"))


def reply(server, **kwargs) -> str:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=12,
        **kwargs,
    )
    return completion.choices[0].message.content


def test_a_long_prompt_served_across_two_ranks_gets_the_single_process_reply(checkpoint, tmp_path):
    single = start_server(tmp_path, "--model", str(checkpoint), *V41_ARGS, *EXACT)
    try:
        expected = reply(single)
    finally:
        assert single.stop() == 0
    parallel = start_server(
        tmp_path,
        "--model",
        str(checkpoint),
        *V41_ARGS,
        *EXACT,
        "--context-parallel-size",
        "2",
    )
    ranks = [pid for worker in children_of(parallel.process.pid) for pid in children_of(worker)]
    try:
        assert ranks, "the worker started no context-parallel rank"
        assert reply(parallel) == expected
        assert reply(parallel, stream=False) == expected  # and again, warm
    finally:
        assert parallel.stop() == 0
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_running(pid) for pid in ranks)
