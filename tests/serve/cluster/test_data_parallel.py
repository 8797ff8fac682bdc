"""`deepwell serve --data-parallel-size 2 --expert-parallel`: each rank a worker behind the
router, the ranks' steps joined by the expert all-to-all; a killed rank fails requests in
OpenAI's error shape, not a hang, and the restarted group serves again."""

import concurrent.futures
import os
import signal
import time

import openai
import pytest
from servers import children_of, free_port, start_server

from deepwell.engine.models.deepseek_v41.writer import TINY_TEXT_CONFIG, write_tiny_checkpoint

pytestmark = pytest.mark.slow


def test_expert_parallel_ranks_serve_and_a_killed_rank_fails_requests_cleanly(tmp_path):
    model = write_tiny_checkpoint(
        tmp_path / "v41", seed=0, text_config=TINY_TEXT_CONFIG | dict(n_routed_experts=16)
    ).path
    server = start_server(
        tmp_path,
        *("--model", str(model), "--data-parallel-size", "2", "--expert-parallel"),
        *("--batch-invariant", "--dtype", "float32", "--threads", "1", "--memory-gib", "0.5"),
        *("--max-model-len", "512", "--num-speculative-tokens", "0"),
        *("--master-port", str(free_port())),
    )
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

    def complete(i: int) -> str:
        reply = client.completions.create(
            model=server.model, prompt=f"hello {i}", max_tokens=8, temperature=0
        )
        return reply.choices[0].text

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(complete, range(8)))
        # Spread over both ranks and batched there, each request's tokens are its own.
        assert together == [complete(i) for i in range(8)]

        os.kill(children_of(server.process.pid)[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failure:
            complete(0)
        assert failure.value.status_code == 503
        assert failure.value.body["message"]
        assert time.monotonic() - started < 30
        # The launcher restarts both ranks; they meet again and serve.
        deadline = time.monotonic() + 120
        while True:
            try:
                assert complete(0) == together[0]
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
    finally:
        assert server.stop() == 0
