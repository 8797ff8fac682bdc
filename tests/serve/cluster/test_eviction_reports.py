"""The router's prefix index under memory pressure: two real engines (the tiny random Llama
of the engine tests) with tiny KV pools behind the request router, over real ZeroMQ sockets; the workers report
the prefix blocks they evict and the index forgets them."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest
import torch
import zmq

from deepwell.engine.kv.prefix_hash import prompt_block_keys
from deepwell.engine.sampling_params import SamplingParams
from deepwell.serve.cluster.assembly import assemble_cluster
from deepwell.serve.cluster.routing import least_outstanding_tokens
from deepwell.serve.messages import GenerateRequest, Shutdown, WorkerConfig, encode_message
from deepwell.serve.worker import EngineCoreAdapter, serve_engine
from deepwell.settings.engine import EngineArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.structured.tiny_tokenizer import tiny_tokenizer  # noqa: E402
from engine.tiny_llama import write_tiny_llama  # noqa: E402

BLOCK = 16
# Pools of 8 blocks of 16 tokens. The index counts a request's prompt blocks only: a long
# answer's blocks push cached prompt blocks out while the index, capped at the pool's size,
# still counts them.
ENGINE = {"block_size": BLOCK, "num_kv_blocks": 8, "max_model_len": 128, "dtype": "float32"}
FIRST = [(7 * i) % 290 + 5 for i in range(48)]
LONG_ANSWER = [(13 * i + 3) % 290 + 5 for i in range(48)]


class Pin:
    """A routing policy that sends to `worker` while set, else the default policy: the test
    places prompts where it wants, then lets the router choose."""

    def __init__(self) -> None:
        self.worker: int | None = None
        self.chosen: int | None = None

    def __call__(self, prompt_tokens, workers):
        if self.worker is None:
            self.chosen = least_outstanding_tokens(prompt_tokens, workers)
        else:
            self.chosen = self.worker
        return self.chosen


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    tiny_tokenizer().save(str(path / "tokenizer.json"))  # the worker sends it to the router
    return str(path)


@pytest.fixture
def workers(model, tmp_path):
    """Two engines with empty caches, each served from a thread."""
    torch.set_num_threads(1)
    args = EngineArgs(model=model, **ENGINE)
    engines = [EngineCoreAdapter(WorkerConfig(i, 0, "", "", args)) for i in (0, 1)]
    context = zmq.Context()
    inboxes = [f"ipc://{tmp_path}/in-{i}" for i in range(2)]
    outbox = f"ipc://{tmp_path}/out"
    sockets, threads = [], []
    for worker_id, (engine, address) in enumerate(zip(engines, inboxes, strict=True)):
        inbox = context.socket(zmq.PULL)
        inbox.bind(address)
        out = context.socket(zmq.PUSH)
        out.connect(outbox)
        sockets += [inbox, out]
        threads.append(threading.Thread(target=serve_engine, args=(engine, worker_id, inbox, out)))
    for thread in threads:
        thread.start()
    yield outbox, inboxes
    sender = context.socket(zmq.PUSH)
    for address in inboxes:
        sender.connect(address)
    for _ in inboxes:
        sender.send(encode_message(Shutdown()))
    for thread in threads:
        thread.join(timeout=30)
    sender.close(linger=0)
    for socket in sockets:
        socket.close(linger=0)
    context.term()


async def run(router, request_id: str, prompt: list[int], max_tokens: int = 1) -> int:
    """Generate; the prompt tokens the worker found cached."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs = [
        output async for output in router.generate(GenerateRequest(request_id, prompt, sampling))
    ]
    return outputs[-1].num_cached_tokens


@pytest.mark.parametrize("reports", [True, False])
def test_a_repeated_prompt_goes_to_the_worker_that_still_holds_it(workers, reports):
    outbox, inboxes = workers

    async def main():
        pin = Pin()
        cluster = assemble_cluster(
            outbox,
            inboxes,
            policy=pin,
            block_size=BLOCK,
            heartbeat_timeout=3600,
            eviction_reports=reports,
        )
        router, pool = cluster.router, cluster.pool
        try:
            model = await pool.start(timeout=120)
            keys = prompt_block_keys(bytes.fromhex(model.fingerprint), FIRST, BLOCK)
            # The first prompt on both workers; then a long answer on worker 0 takes 7 of
            # its 8 blocks, evicting most of the first prompt's.
            for worker_id in (1, 0):
                pin.worker = worker_id
                await run(router, f"first-{worker_id}", FIRST)
            await run(router, "long", LONG_ANSWER, max_tokens=64)
            held = [pool.workers[i].prefixes.hit_blocks(keys) for i in (0, 1)]
            pin.worker = None
            cached = await run(router, "again", FIRST)
        finally:
            await pool.close()
        return held, pin.chosen, cached

    held, chosen, cached = asyncio.run(main())
    if reports:
        # Worker 0 reported the blocks it evicted; worker 1 holds all three.
        assert held[0] < 3 and held[1] == 3
        assert chosen == 1 and cached == 32  # a hit leaves the last block's tokens to compute
    else:
        # The index still credits worker 0, which wins the tie and finds less than it hoped.
        assert held == [3, 3]
        assert chosen == 0 and cached < 32
