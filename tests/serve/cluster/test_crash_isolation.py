"""A request that crashes every worker it reaches: the router charges worker crashes to
the requests a dead worker had not yet answered, fails a request at its second charge
(500, naming its request id) instead of rerouting it again, and moves the others on.

Scripted engines in threads over real ZeroMQ sockets (a worker "dies" the way the pool
sees a crash it cannot hear: its heartbeats stop and it never answers again), and, in the
slow suite, `deepwell serve` whose real worker processes a marked prompt crashes
(the worker's test hook, serve/worker_test_hooks.py)."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from servers import start_server
from thread_workers import ThreadWorkers

from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stats import EngineStats
from deepwell.serve.cluster.assembly import assemble_cluster
from deepwell.serve.cluster.inference_errors import RequestCrashedWorkers
from deepwell.serve.messages import GenerateRequest, ModelInfo
from deepwell.settings.environment import WORKER_EXIT_ON_PROMPT_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))
from structured.tiny_tokenizer import tiny_tokenizer  # noqa: E402
from tiny_llama import write_tiny_llama  # noqa: E402

MODEL = ModelInfo("positional", "none", 4096, "{}", None, [0], fingerprint="00" * 16)
# The first prompt token of the request that kills a worker when it arrives.
POISON = 666
PROMPT = [1, 2, 3]


class MortalEngine:
    """Token at sequence position p is 1000 + p (so a continuation elsewhere reads the
    same); a request whose prompt starts with POISON kills the worker as it arrives."""

    def __init__(self, step_s: float = 0.01) -> None:
        self.step_s = step_s
        self.requests: dict[str, list] = {}
        self.dead = False
        self.on_death = lambda: None

    def add_request(self, request: GenerateRequest) -> None:
        if self.dead:
            return
        if request.prompt_token_ids[0] == POISON:
            self.dead = True
            self.requests.clear()
            self.on_death()
            return
        self.requests[request.request_id] = [request, 0]

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outputs = []
        for request_id, state in list(self.requests.items()):
            request, produced = state
            state[1] = produced + 1
            done = state[1] >= request.sampling.max_tokens
            if done:
                del self.requests[request_id]
            token = 1000 + len(request.prompt_token_ids) + produced
            finish = FinishReason.LENGTH if done else None
            outputs.append(RequestOutput(request_id, [token], [], finish, 3, produced + 1))
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, len(self.requests), 64)

    def key_changes(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def model_info(self) -> ModelInfo:
        return MODEL


@pytest.fixture
def workers(tmp_path):
    made = []

    def make(count: int) -> ThreadWorkers:
        made.append(ThreadWorkers(tmp_path, [MortalEngine() for _ in range(count)]))
        return made[-1]

    yield make
    for group in made:
        group.close()


def _request(request_id: str, max_tokens: int, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=7))


async def _tokens(router, request: GenerateRequest, answered: asyncio.Event) -> list[int]:
    tokens = []
    # A poison rerouted without end would hang on the last worker: fail instead.
    async with asyncio.timeout(60):
        async for output in router.generate(request):
            tokens += output.new_token_ids
            answered.set()
    return tokens


def test_a_request_that_crashes_two_workers_fails_and_the_others_finish(workers, tmp_path):
    group = workers(3)
    max_tokens = 300

    async def main():
        cluster = assemble_cluster(group.outbox, group.inboxes, heartbeat_timeout=0.5)
        await cluster.pool.start(timeout=10)
        router = cluster.router
        answered = [asyncio.Event() for _ in range(6)]
        streams = [
            asyncio.create_task(_tokens(router, _request(f"r{i}", max_tokens, PROMPT), seen))
            for i, seen in enumerate(answered)
        ]
        # Every stream has been answered once before the poison arrives: none is a suspect.
        await asyncio.gather(*(seen.wait() for seen in answered))
        poison = _request("poison", 8, [POISON, *PROMPT])
        with pytest.raises(RequestCrashedWorkers) as failed:
            await _tokens(router, poison, asyncio.Event())
        finished = await asyncio.gather(*streams)
        views = router.views()
        quarantined = cluster.latency.quarantined
        await cluster.pool.close()
        return failed.value, finished, views, quarantined

    error, finished, views, quarantined = asyncio.run(main())
    assert error.status_code == 500
    assert str(error) == (
        "this request crashed 2 engine workers and is not retried (request id poison)"
    )
    expected = [1000 + len(PROMPT) + i for i in range(max_tokens)]
    assert finished == [expected] * 6
    assert sorted(view.live for view in views) == [False, False, True]
    assert quarantined == 1


def test_at_one_crash_per_request_the_poison_fails_at_its_first(workers):
    group = workers(3)

    async def run(crashes_per_request: int) -> list:
        cluster = assemble_cluster(
            group.outbox,
            group.inboxes,
            heartbeat_timeout=0.5,
            crashes_per_request=crashes_per_request,
        )
        await cluster.pool.start(timeout=10)
        poison = _request("poison", 8, [POISON, *PROMPT])
        with pytest.raises(RequestCrashedWorkers) as failed:
            await _tokens(cluster.router, poison, asyncio.Event())
        dead = sum(not view.live for view in cluster.router.views())
        await cluster.pool.close()
        return str(failed.value), dead

    message, dead = asyncio.run(run(crashes_per_request=1))
    assert message.startswith("this request crashed 1 engine workers")
    assert dead == 1


# The prompt text the real workers exit on, in the slow test.
POISON_TEXT = "POISON-PILL-7f3a"


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def _seeded_streams(base_url: str, model: str, poison: bool) -> tuple[list[str], object]:
    """Six seeded chat streams; with `poison`, once each has produced text, a request that
    crashes every worker it reaches. Returns the streams' texts and the poison's error."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    started = [asyncio.Event() for _ in range(6)]

    async def one(index: int) -> str:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Write line {index} of a poem."}],
            max_tokens=200,
            temperature=1.0,
            seed=300 + index,
            stream=True,
        )
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                started[index].set()
        started[index].set()
        return "".join(parts)

    streams = [asyncio.create_task(one(index)) for index in range(6)]
    error = None
    if poison:
        await asyncio.gather(*(event.wait() for event in started))
        try:
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Say {POISON_TEXT}."}],
                max_tokens=8,
            )
        except openai.APIStatusError as raised:
            error = raised
    texts = await asyncio.gather(*streams)
    await client.close()
    return texts, error


@pytest.mark.slow
def test_a_prompt_that_crashes_real_workers_fails_after_two(tmp_path, monkeypatch):
    """Three real workers (the tiny random Llama, which loads in seconds where the embedded
    model's three took over 10 minutes on the loaded 2-core machine): the marked request
    kills two (both restarted), ends with a 500 naming its request id, and the six
    streams beside it read as they do undisturbed."""
    model = write_tiny_llama(tmp_path / "tiny-llama")
    tiny_tokenizer().save(str(model / "tokenizer.json"))
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    monkeypatch.setenv(WORKER_EXIT_ON_PROMPT_ENV, POISON_TEXT)
    server = start_server(
        tmp_path,
        *("--model", str(model), "--chat-template", str(template), "--dtype", "float32"),
        *("--memory-gib", "0.25", "--threads", "1", "--batch-invariant"),
        *("--workers", "3", "--heartbeat-timeout", "10"),
        timeout=900,
    )
    try:
        model = server.model
        undisturbed, _ = asyncio.run(_seeded_streams(server.base_url, model, poison=False))
        disturbed, error = asyncio.run(_seeded_streams(server.base_url, model, poison=True))
        deadline = time.monotonic() + 600
        while _metric(server.base_url, "deepwell_worker_up") < 3:
            assert time.monotonic() < deadline, "the crashed workers did not rejoin"
            time.sleep(1)
        while _metric(server.base_url, "deepwell_kv_blocks_used") and time.monotonic() < deadline:
            time.sleep(0.5)
        restarts = _metric(server.base_url, "deepwell_worker_restarts_total")
        quarantined = _metric(server.base_url, "deepwell_quarantined_requests_total")
        blocks = _metric(server.base_url, "deepwell_kv_blocks_used")
    finally:
        assert server.stop() == 0
    assert all(undisturbed)
    assert disturbed == undisturbed
    assert isinstance(error, openai.InternalServerError)
    request_id = error.response.headers["x-request-id"]
    assert error.body["message"] == (
        f"this request crashed 2 engine workers and is not retried (request id {request_id})"
    )
    assert error.body["type"] == "internal_error"
    assert (restarts, quarantined, blocks) == (2, 1, 0)
