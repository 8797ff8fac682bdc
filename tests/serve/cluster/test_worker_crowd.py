"""Crowds through the whole worker path: the request router, ZeroMQ, the worker loop and a
real engine (the tiny random Llama), with requests arriving at random moments and clients
leaving, batch-invariant or not, asynchronous or not. Every request must end, and the worker
must go idle holding no block: the loop must never sit in its poll beside a held request."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from deepwell.engine import EngineArgs
from deepwell.engine.sampling_params import SamplingParams
from deepwell.serve.cluster.assembly import assemble_cluster
from deepwell.serve.messages import GenerateRequest, Shutdown, WorkerConfig, encode_message
from deepwell.serve.worker import EngineCoreAdapter, serve_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))
from structured.tiny_tokenizer import tiny_tokenizer  # noqa: E402
from tiny_llama import write_tiny_llama  # noqa: E402

MODES = [(True, True), (True, False), (False, True), (False, False)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("crowd_llama"))
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    return path


@dataclass
class CrowdCounts:
    requests: int = 0
    finished: int = 0
    left: int = 0
    # Requests with no output for 120 s: what the test exists to rule out.
    stranded: int = 0


async def _crowds(cluster, seconds: float, seed: int) -> CrowdCounts:
    """Crowds of 1-12 requests, each after a random delay, a few left early by their
    client."""
    rng = random.Random(seed)
    counts = CrowdCounts()

    async def one(request_id: str) -> None:
        await asyncio.sleep(rng.random() * 0.2)
        prompt = [rng.randrange(3, 320) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 40), temperature=1.0, seed=rng.randrange(9)
        )
        leave_after = rng.randint(1, 5) if rng.random() < 0.15 else None
        stream = cluster.router.generate(GenerateRequest(request_id, prompt, params))
        counts.requests += 1
        seen = 0
        try:
            async with asyncio.timeout(120):
                async for output in stream:
                    seen += 1
                    if leave_after is not None and seen >= leave_after:
                        counts.left += 1
                        return
                    if output.finished:
                        counts.finished += 1
        except TimeoutError:
            counts.stranded += 1
        finally:
            await stream.aclose()

    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    round_ = 0
    while loop.time() < deadline:
        crowd = [one(f"{round_}-{index}") for index in range(rng.randint(1, 12))]
        await asyncio.gather(*crowd)
        round_ += 1
    return counts


def _run(tiny_model: Path, tmp_path: Path, invariant: bool, overlap: bool, seconds: float):
    args = EngineArgs(
        model=str(tiny_model),
        dtype="float32",
        block_size=16,
        memory_gib=0.25,
        num_kv_blocks=12,
        max_model_len=128,
        max_num_batched_tokens=64,
        batch_invariant=invariant,
        async_scheduling=overlap,
        num_threads=1,
    )
    inbox_address, outbox_address = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    engine = EngineCoreAdapter(WorkerConfig(0, 0, inbox_address, outbox_address, args))
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(outbox_address)
    loop_thread = threading.Thread(target=serve_engine, args=(engine, 0, inbox, outbox))
    loop_thread.start()

    async def main():
        cluster = assemble_cluster(outbox_address, [inbox_address], block_size=16)
        await cluster.pool.start(timeout=60)
        result = await _crowds(cluster, seconds, seed=int(invariant) * 2 + int(overlap))
        # Aborts and last outputs reach the worker, then its stats come back.
        for _ in range(500):
            stats = cluster.pool.stats()
            if stats.running == stats.waiting == stats.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.02)
        await cluster.pool.close()
        return result, stats

    started = time.monotonic()
    try:
        counts, stats = asyncio.run(main())
    finally:
        loop_thread.join(timeout=10)
        if loop_thread.is_alive():  # the pool's Shutdown did not arrive: send another
            sender = context.socket(zmq.PUSH)
            sender.connect(inbox_address)
            sender.send(encode_message(Shutdown()))
            sender.close(linger=1000)
            loop_thread.join(timeout=10)
        inbox.close(0)
        outbox.close(0)
        context.term()
        engine.close()
    # The figures a long run reports (pytest -rP shows them).
    print(
        f"crowd invariant={invariant} async={overlap}: {counts.requests} requests, "
        f"{counts.finished} finished, {counts.left} left, {counts.stranded} stranded, "
        f"{time.monotonic() - started:.0f} s"
    )
    assert counts.stranded == 0
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.stuck_requests_ended == 0
    assert not engine.has_unfinished()
    return counts


@pytest.mark.parametrize(("invariant", "overlap"), MODES)
def test_every_request_of_a_crowd_ends_through_the_worker(tiny_model, tmp_path, invariant, overlap):
    assert _run(tiny_model, tmp_path, invariant, overlap, seconds=1.5).finished > 0


@pytest.mark.slow
@pytest.mark.parametrize(("invariant", "overlap"), MODES)
def test_every_request_of_a_crowd_ends_through_the_worker_for_ten_minutes(
    tiny_model, tmp_path, invariant, overlap
):
    assert _run(tiny_model, tmp_path, invariant, overlap, seconds=600.0).finished > 0
