"""The worker loop and the cluster (worker pool and request router) over real ZeroMQ sockets,
with a scripted engine."""

import asyncio
import threading

import pytest
import zmq

from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stats import EngineStats
from deepwell.serve.cluster.assembly import assemble_cluster
from deepwell.serve.cluster.inference_errors import (
    DeadlineExceeded,
    EngineUnavailable,
    RequestRejected,
)
from deepwell.serve.messages import (
    GenerateRequest,
    ModelInfo,
    Shutdown,
    encode_message,
)
from deepwell.serve.worker import serve_engine


class CountingEngine:
    """Emits token 100, 101, … one per step per request; one KV block per request."""

    def __init__(self):
        self.requests = {}
        self.aborted = []

    def add_request(self, request):
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.requests[request.request_id] = [request, 0]

    def abort(self, request_ids):
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        outputs = []
        for request_id, state in list(self.requests.items()):
            request, produced = state
            state[1] = produced + 1
            done = state[1] >= request.sampling.max_tokens
            if done:
                del self.requests[request_id]
            finish = FinishReason.LENGTH if done else None
            outputs.append(RequestOutput(request_id, [100 + produced], [], finish, 3, produced + 1))
        return outputs

    def stats(self):
        n = len(self.requests)
        return EngineStats(n, 0, n, 8)

    def key_changes(self):
        return [], []

    def model_info(self):
        return ModelInfo("counting", "none", 4096, "{}", None, [0])


@pytest.fixture
def worker(tmp_path):
    engine = CountingEngine()
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(f"ipc://{tmp_path}/in")
    outbox = context.socket(zmq.PUSH)
    outbox.connect(f"ipc://{tmp_path}/out")
    thread = threading.Thread(target=serve_engine, args=(engine, 0, inbox, outbox))
    thread.start()
    yield engine, f"ipc://{tmp_path}/out", [f"ipc://{tmp_path}/in"], thread
    thread.join(timeout=5)
    inbox.close(0)
    outbox.close(0)
    context.term()


def request(request_id, max_tokens):
    return GenerateRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def test_generate_streams_every_token_then_finishes(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        cluster = assemble_cluster(outbox, inboxes)
        model = await cluster.pool.start(timeout=5)
        assert model.name == "counting"
        outputs = [o async for o in cluster.router.generate(request("a", 4))]
        await cluster.pool.close()
        return outputs

    outputs = asyncio.run(main())
    assert [o.new_token_ids for o in outputs] == [[100], [101], [102], [103]]
    assert [o.finish_reason for o in outputs] == [None, None, None, "length"]
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_closing_a_stream_aborts_it_and_frees_its_blocks(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        cluster = assemble_cluster(outbox, inboxes)
        await cluster.pool.start(timeout=5)
        stream = cluster.router.generate(request("b", 10_000_000))
        first = await anext(stream)
        await stream.aclose()
        # Up to 10 s for the abort to reach the worker and its stats to come back: 1 s was
        # not enough with the two cores shared by a dozen processes (load average 16).
        for _ in range(1000):
            if cluster.pool.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        stats = cluster.pool.stats()
        await cluster.pool.close()
        return first, stats

    first, stats = asyncio.run(main())
    assert first.new_token_ids == [100]
    assert engine.aborted == ["b"]
    assert stats.kv_blocks_used == 0 and stats.running == 0


def test_a_lost_worker_fails_its_requests(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        cluster = assemble_cluster(outbox, inboxes)
        await cluster.pool.start(timeout=5)
        stream = cluster.router.generate(request("c", 10_000_000))
        await anext(stream)
        cluster.pool.remove(0, "killed", failed=True)
        with pytest.raises(EngineUnavailable, match="killed"):
            async for _ in stream:
                pass
        assert not cluster.pool.healthy
        with pytest.raises(EngineUnavailable):
            await anext(cluster.router.generate(request("d", 1)))
        await cluster.pool.close()

    asyncio.run(main())
    # The worker was never told to shut down; it is still running the loop.
    assert thread.is_alive()
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.connect(inboxes[0])
    socket.send(encode_message(Shutdown()))
    socket.close(linger=1000)
    context.term()


def test_a_request_the_engine_refuses_fails_alone(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        cluster = assemble_cluster(outbox, inboxes)
        await cluster.pool.start(timeout=5)
        empty = GenerateRequest("e", [], SamplingParams(max_tokens=4))
        with pytest.raises(RequestRejected, match="the prompt is empty"):
            await anext(cluster.router.generate(empty))
        outputs = [o async for o in cluster.router.generate(request("f", 2))]
        await cluster.pool.close()
        return outputs

    assert [o.new_token_ids for o in asyncio.run(main())] == [[100], [101]]


def test_a_deadline_frees_the_blocks_of_a_request_nobody_reads(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        cluster = assemble_cluster(outbox, inboxes, request_timeout_s=0.3)
        await cluster.pool.start(timeout=5)
        stream = cluster.router.generate(request("slow", 10_000_000))
        await anext(stream)
        # The reader stops; the deadline must still abort the request on its worker.
        for _ in range(1000):
            await asyncio.sleep(0.01)
            if engine.aborted and cluster.pool.stats().kv_blocks_used == 0:
                break
        stats = cluster.pool.stats()
        with pytest.raises(DeadlineExceeded, match="deadline of 0.3 s"):
            async for _ in stream:
                pass
        expiries = cluster.router.deadline_expiries
        await cluster.pool.close()
        return stats, expiries

    stats, expiries = asyncio.run(main())
    assert engine.aborted == ["slow"]
    assert stats.kv_blocks_used == 0
    assert expiries == 1


def test_a_request_finished_before_its_deadline_is_not_expired(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        cluster = assemble_cluster(outbox, inboxes, request_timeout_s=0.2)
        await cluster.pool.start(timeout=5)
        outputs = [o async for o in cluster.router.generate(request("quick", 2))]
        await asyncio.sleep(0.4)
        expiries = cluster.router.deadline_expiries
        await cluster.pool.close()
        return outputs, expiries

    outputs, expiries = asyncio.run(main())
    assert outputs[-1].finish_reason == "length"
    assert expiries == 0
    assert engine.aborted == []


def test_requests_count_as_waiting_until_their_first_output(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        cluster = assemble_cluster(outbox, inboxes)
        await cluster.pool.start(timeout=5)
        assert cluster.router.num_waiting() == 0
        stream = cluster.router.generate(request("w", 10_000_000))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # dispatched, nothing back yet
        waiting = cluster.router.num_waiting()
        await first
        after = cluster.router.num_waiting()
        await stream.aclose()
        await cluster.pool.close()
        return waiting, after

    assert asyncio.run(main()) == (1, 0)
