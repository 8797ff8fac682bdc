"""The worker loop and the engine client over real ZeroMQ sockets, with a scripted engine."""

import asyncio
import threading

import pytest
import zmq

from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stats import EngineStats
from deepwell.serve.engine_client import EngineClient, EngineUnavailable, RequestRejected
from deepwell.serve.messages import (
    GenerateRequest,
    ModelInfo,
    Shutdown,
    TokenOutput,
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
            outputs.append(
                TokenOutput(request_id, [100 + produced], "length" if done else None, 3, 0, None)
            )
        return outputs

    def stats(self):
        n = len(self.requests)
        return EngineStats(n, 0, n, 8)

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
        client = EngineClient(outbox, inboxes)
        model = await client.start(timeout=5)
        assert model.name == "counting"
        outputs = [o async for o in client.generate(request("a", 4))]
        await client.close()
        return outputs

    outputs = asyncio.run(main())
    assert [o.token_ids for o in outputs] == [[100], [101], [102], [103]]
    assert [o.finish_reason for o in outputs] == [None, None, None, "length"]
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_closing_a_stream_aborts_it_and_frees_its_blocks(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        client = EngineClient(outbox, inboxes)
        await client.start(timeout=5)
        stream = client.generate(request("b", 10_000_000))
        first = await anext(stream)
        await stream.aclose()
        for _ in range(100):
            if client.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        stats = client.stats()
        await client.close()
        return first, stats

    first, stats = asyncio.run(main())
    assert first.token_ids == [100]
    assert engine.aborted == ["b"]
    assert stats.kv_blocks_used == 0 and stats.running == 0


def test_a_lost_worker_fails_its_requests(worker):
    engine, outbox, inboxes, thread = worker

    async def main():
        client = EngineClient(outbox, inboxes)
        await client.start(timeout=5)
        stream = client.generate(request("c", 10_000_000))
        await anext(stream)
        client.worker_lost(0, "killed")
        with pytest.raises(EngineUnavailable, match="killed"):
            async for _ in stream:
                pass
        assert not client.healthy
        with pytest.raises(EngineUnavailable):
            await anext(client.generate(request("d", 1)))
        await client.close()

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
        client = EngineClient(outbox, inboxes)
        await client.start(timeout=5)
        empty = GenerateRequest("e", [], SamplingParams(max_tokens=4))
        with pytest.raises(RequestRejected, match="the prompt is empty"):
            await anext(client.generate(empty))
        outputs = [o async for o in client.generate(request("f", 2))]
        await client.close()
        return outputs

    assert [o.token_ids for o in asyncio.run(main())] == [[100], [101]]
