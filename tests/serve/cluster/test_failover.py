"""Routing, failover, PD hand-off, heartbeats and fingerprint refusal in the request router
and worker pool, over real ZeroMQ sockets with scripted engines in threads."""

import asyncio
import threading
import time

import pytest
import zmq
from servers import free_port
from thread_workers import ThreadWorkers

from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stats import EngineStats
from deepwell.serve.cluster.assembly import assemble_cluster
from deepwell.serve.cluster.inference_errors import DrainRefused, EngineUnavailable
from deepwell.serve.cluster.worker_pool import WorkerRole
from deepwell.serve.messages import (
    GenerateRequest,
    ModelInfo,
)
from deepwell.serve.worker import serve_engine

MODEL = ModelInfo("positional", "none", 4096, "{}", None, [0], fingerprint="00" * 16)


class PositionalEngine:
    """Token at sequence position p is 1000 + p: a continuation on another worker, given
    the produced tokens as prompt, produces what the first would have."""

    def __init__(self, model=MODEL, step_s=0.005):
        self.model = model
        self.step_s = step_s
        self.requests = {}
        self.received = []

    def add_request(self, request):
        self.received.append(request)
        self.requests[request.request_id] = [request, 0]

    def abort(self, request_ids):
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        time.sleep(self.step_s)
        outputs = []
        for request_id, state in list(self.requests.items()):
            request, produced = state
            token = 1000 + len(request.prompt_token_ids) + produced
            state[1] = produced + 1
            done = state[1] >= request.sampling.max_tokens
            if done:
                del self.requests[request_id]
            finish = FinishReason.LENGTH if done else None
            outputs.append(RequestOutput(request_id, [token], [], finish, 3, produced + 1))
        return outputs

    def stats(self):
        n = len(self.requests)
        return EngineStats(n, 0, n, 64)

    def key_changes(self):
        return [], []

    def model_info(self):
        return self.model


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(*engines):
        made.append(ThreadWorkers(tmp_path, list(engines)))
        return made[-1]

    yield make
    for workers in made:
        workers.close()


def request(request_id, max_tokens, prompt=(1, 2, 3)):
    return GenerateRequest(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, seed=7))


async def collect(stream):
    return [token async for output in stream for token in output.new_token_ids]


def test_requests_spread_over_workers_by_outstanding_tokens(cluster):
    workers = cluster(PositionalEngine(), PositionalEngine())

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes)
        await cluster.pool.start(timeout=5)
        results = await asyncio.gather(
            *(collect(cluster.router.generate(request(str(i), 5))) for i in range(4))
        )
        views = cluster.router.views()
        await cluster.pool.close()
        return results, views

    results, views = asyncio.run(main())
    assert results == [[1003, 1004, 1005, 1006, 1007]] * 4
    assert [v.routed_requests for v in views] == [2, 2]
    assert [len(e.received) for e in workers.engines] == [2, 2]


def test_a_lost_workers_stream_continues_on_another_without_gap_or_duplicate(cluster):
    workers = cluster(PositionalEngine(), PositionalEngine())

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes)
        await cluster.pool.start(timeout=5)
        stream = cluster.router.generate(request("a", 30))
        tokens = []
        async for output in stream:
            tokens += output.new_token_ids
            if len(tokens) == 5:
                cluster.pool.remove(0, "killed", failed=True)
        views = cluster.router.views()
        await cluster.pool.close()
        return tokens, views

    tokens, views = asyncio.run(main())
    assert tokens == list(range(1003, 1033))
    first, second = workers.engines
    (continuation,) = second.received
    # The produced tokens became prompt; the budget shrank by as many; the seed stayed.
    assert continuation.prompt_token_ids[:3] == [1, 2, 3]
    assert continuation.prompt_token_ids[3:] == tokens[: len(continuation.prompt_token_ids) - 3]
    assert continuation.sampling.max_tokens == 30 - (len(continuation.prompt_token_ids) - 3)
    assert continuation.sampling.seed == 7
    assert views[0].failure == "killed" and views[1].live


def test_without_another_worker_a_lost_workers_stream_fails_clearly(cluster):
    workers = cluster(PositionalEngine())

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes)
        await cluster.pool.start(timeout=5)
        stream = cluster.router.generate(request("a", 10_000))
        await anext(stream)
        cluster.pool.remove(0, "killed", failed=True)
        with pytest.raises(EngineUnavailable, match="no engine worker is available"):
            await collect(stream)
        await cluster.pool.close()

    asyncio.run(main())


def test_a_silent_worker_is_dropped_within_the_heartbeat_timeout(cluster):
    workers = cluster(PositionalEngine(), PositionalEngine())

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes, heartbeat_timeout=0.5)
        await cluster.pool.start(timeout=5)
        stream = cluster.router.generate(request("a", 400))
        tokens = [*(await anext(stream)).new_token_ids]
        workers.silence(0)
        # The worker still computes, but nothing it says counts once it is taken for dead.
        workers.engines[0].step_s = 2.0
        start = time.monotonic()
        while cluster.router.views()[0].live:
            await asyncio.sleep(0.02)
        noticed = time.monotonic() - start
        tokens += await collect(stream)
        await cluster.pool.close()
        return tokens, noticed

    tokens, noticed = asyncio.run(main())
    assert noticed < 1.5
    assert tokens == list(range(1003, 1403))


def test_a_started_worker_gets_the_hung_timeout_before_it_is_taken_for_dead(cluster):
    """A worker the server started is dead when its process exits; silence only means it may
    hang, so it is given `hung_timeout`, not the heartbeat timeout of a joined worker."""
    workers = cluster(PositionalEngine(), PositionalEngine())

    async def main():
        cluster = assemble_cluster(
            workers.outbox, workers.inboxes, heartbeat_timeout=0.2, hung_timeout=1.5
        )
        await cluster.pool.start(timeout=5)
        workers.silence(0)
        start = time.monotonic()
        await asyncio.sleep(0.8)
        live_past_the_heartbeat_timeout = cluster.router.views()[0].live
        while cluster.router.views()[0].live:
            await asyncio.sleep(0.02)
        noticed = time.monotonic() - start
        await cluster.pool.close()
        return live_past_the_heartbeat_timeout, noticed

    live_past_the_heartbeat_timeout, noticed = asyncio.run(main())
    assert live_past_the_heartbeat_timeout
    assert 1.4 < noticed < 3.0


def test_a_worker_with_another_fingerprint_is_refused(cluster):
    foreign = ModelInfo("positional", "none", 4096, "{}", None, [0], fingerprint="ff" * 16)
    workers = cluster(PositionalEngine(), PositionalEngine(model=foreign))

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes)
        with pytest.raises(EngineUnavailable, match="refused: .*fingerprint ffff"):
            await cluster.pool.start(timeout=5)
        await cluster.pool.close()

    asyncio.run(main())


def test_pd_prefill_worker_computes_the_prompt_and_a_decode_worker_continues(cluster):
    workers = cluster(PositionalEngine(), PositionalEngine())

    async def main():
        cluster = assemble_cluster(
            workers.outbox, workers.inboxes, roles=[WorkerRole.PREFILL, WorkerRole.DECODE]
        )
        await cluster.pool.start(timeout=5)
        tokens = await collect(cluster.router.generate(request("a", 6)))
        await cluster.pool.close()
        return tokens, cluster.latency.handed_off

    tokens, handed_off = asyncio.run(main())
    assert tokens == list(range(1003, 1009)) and handed_off == 1
    (prefill,) = workers.engines[0].received
    (decode,) = workers.engines[1].received
    assert prefill.sampling.max_tokens == 1 and prefill.prompt_token_ids == [1, 2, 3]
    assert decode.prompt_token_ids == [1, 2, 3, 1003] and decode.sampling.max_tokens == 5


def test_drain_is_refused_while_the_others_would_be_too_full(cluster):
    workers = cluster(PositionalEngine(), PositionalEngine())

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes)
        await cluster.pool.start(timeout=5)
        stream = cluster.router.generate(request("a", 50))
        await anext(stream)
        # One block in use of the other worker's 64: 1.6 %, over a 1 % limit.
        with pytest.raises(DrainRefused, match="would leave the others at 2% .* limit of 1%"):
            await cluster.router.drain(0, max_utilisation=0.01, timeout=5)
        assert not any(view.draining for view in cluster.router.views())
        await collect(stream)
        await cluster.pool.close()

    asyncio.run(main())


def test_the_last_worker_cannot_be_drained(cluster):
    workers = cluster(PositionalEngine())

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes)
        await cluster.pool.start(timeout=5)
        with pytest.raises(DrainRefused, match="inf"):
            await cluster.router.drain(0, max_utilisation=0.8, timeout=5)
        with pytest.raises(DrainRefused, match="no serving engine worker 3"):
            await cluster.router.drain(3, max_utilisation=0.8, timeout=5)
        await cluster.pool.close()

    asyncio.run(main())


@pytest.mark.parametrize(("timeout", "finished", "migrated"), [(30.0, 1, 0), (0.0, 0, 1)])
def test_drain_finishes_or_moves_the_workers_requests_then_stops_it(
    cluster, timeout, finished, migrated
):
    workers = cluster(PositionalEngine(), PositionalEngine())

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes)
        await cluster.pool.start(timeout=5)
        stream = cluster.router.generate(request("a", 40))
        tokens = [*(await anext(stream)).new_token_ids]
        result = await cluster.router.drain(0, max_utilisation=0.8, timeout=timeout)
        tokens += await collect(stream)
        # New requests go to the remaining worker.
        after = await collect(cluster.router.generate(request("b", 2)))
        views = cluster.router.views()
        await cluster.pool.close()
        return result, tokens, after, views

    result, tokens, after, views = asyncio.run(main())
    assert (result.finished, result.migrated) == (finished, migrated)
    assert tokens == list(range(1003, 1043)) and after == [1003, 1004]
    assert views[0].failure == "drained" and not views[0].live
    assert [r.request_id for r in workers.engines[1].received][-1] == "b"
    # The drained worker was told to exit.
    workers.threads[0].join(timeout=5)
    assert not workers.threads[0].is_alive()


def joining_worker(context, engine, worker_id, join_address, result):
    """A worker that was not started by the front end: tcp inbox, announced in WorkerReady."""
    inbox = context.socket(zmq.PULL)
    inbox.bind("tcp://127.0.0.1:*")
    outbox = context.socket(zmq.PUSH)
    outbox.connect(join_address)
    address = inbox.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        result.append(serve_engine(engine, worker_id, inbox, outbox, None, address))
    finally:
        inbox.close(linger=0)
        outbox.close(linger=0)


def test_a_worker_joins_over_tcp_and_one_with_another_fingerprint_is_refused(cluster, tmp_path):
    workers = cluster(PositionalEngine())
    join_address = f"tcp://127.0.0.1:{free_port()}"
    foreign = ModelInfo("other", "none", 4096, "{}", None, [0], fingerprint="ff" * 16)
    joiner, stranger = PositionalEngine(), PositionalEngine(model=foreign)
    results = {7_000_001: [], 7_000_002: []}

    async def main():
        cluster = assemble_cluster(workers.outbox, workers.inboxes, join_address=join_address)
        await cluster.pool.start(timeout=5)
        threads = [
            threading.Thread(
                target=joining_worker,
                args=(workers.context, engine, worker_id, join_address, results[worker_id]),
            )
            for worker_id, engine in ((7_000_001, joiner), (7_000_002, stranger))
        ]
        for thread in threads:
            thread.start()

        def settled():
            views = {view.worker_id: view for view in cluster.router.views()}
            joined, refused = views.get(7_000_001), views.get(7_000_002)
            return joined and joined.live and refused and refused.failure

        while not settled():
            await asyncio.sleep(0.02)
        # Both workers idle: the default policy's tie goes to the lowest id, so occupy it.
        busy = cluster.router.generate(request("busy", 10_000))
        await anext(busy)
        joined = await collect(cluster.router.generate(request("joined", 3)))
        await busy.aclose()
        views = {view.worker_id: view for view in cluster.router.views()}
        await cluster.pool.close()
        for thread in threads:
            thread.join(timeout=5)
        return joined, views

    joined, views = asyncio.run(main())
    assert joined == [1003, 1004, 1005]
    assert [r.request_id for r in joiner.received] == ["joined"]
    assert views[7_000_001].live
    refusal = views[7_000_002].failure
    assert refusal.startswith("refused: it serves other (fingerprint ffff")
    assert "the cluster serves positional" in refusal
    (stop,) = results[7_000_002]
    assert stop.refusal == refusal
