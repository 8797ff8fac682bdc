"""The engine worker's loop keeps serving when the engine raises on one request it can
name, and leaves the error to kill the worker when it cannot: the real engine (the tiny
random Llama), its step made to raise by the worker's test hook."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest
import zmq

from deepwell.engine import EngineArgs
from deepwell.engine.sampling_params import SamplingParams
from deepwell.serve.cluster.assembly import assemble_cluster
from deepwell.serve.cluster.inference_errors import EngineFailedRequest
from deepwell.serve.messages import GenerateRequest, Shutdown, WorkerConfig, encode_message
from deepwell.serve.worker import EngineCoreAdapter, serve_engine
from deepwell.serve.worker_test_hooks import with_test_hooks
from deepwell.settings.environment import WORKER_RAISE_ON_PROMPT_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from structured.tiny_tokenizer import tiny_tokenizer  # noqa: E402
from tiny_llama import write_tiny_llama  # noqa: E402

MARKER = "POISON"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("worker_llama"))
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    return path


def _engine(tiny_model: Path, tmp_path: Path, overlap: bool):
    args = EngineArgs(
        model=str(tiny_model),
        dtype="float32",
        block_size=16,
        memory_gib=0.25,
        num_kv_blocks=12,
        max_model_len=128,
        async_scheduling=overlap,
        num_threads=1,
    )
    config = WorkerConfig(0, 0, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", args)
    environ = {WORKER_RAISE_ON_PROMPT_ENV: MARKER}
    return config, with_test_hooks(EngineCoreAdapter(config), environ)


def _request(request_id: str, text: str, max_tokens: int = 6) -> GenerateRequest:
    prompt = tiny_tokenizer().encode(text).ids
    return GenerateRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=1))


class LoopThread(threading.Thread):
    """`serve_engine` in a thread, keeping what it raised."""

    def __init__(self, engine, inbox, outbox) -> None:
        super().__init__()
        self.loop_args = (engine, 0, inbox, outbox)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            serve_engine(*self.loop_args)
        except BaseException as error:
            self.error = error


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_request_the_step_raises_on_fails_alone_and_the_worker_serves_on(
    tiny_model, tmp_path, overlap
):
    config, engine = _engine(tiny_model, tmp_path, overlap)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(config.inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(config.outbox_address)
    loop = LoopThread(engine, inbox, outbox)
    loop.start()

    async def main():
        cluster = assemble_cluster(config.outbox_address, [config.inbox_address], block_size=16)
        await cluster.pool.start(timeout=60)
        with pytest.raises(EngineFailedRequest) as failed:
            async for _ in cluster.router.generate(_request("bad", f"a {MARKER} b")):
                pass
        after = [
            output async for output in cluster.router.generate(_request("good", "hello there"))
        ]
        await cluster.pool.close()
        return failed.value, after

    try:
        error, after = asyncio.run(main())
    finally:
        loop.join(timeout=20)
        inbox.close(0)
        outbox.close(0)
        context.term()
    stats = engine.stats()
    engine.close()
    assert loop.error is None
    assert error.status_code == 500
    assert str(error) == "the engine failed on this request (RuntimeError) (request id bad)"
    assert after[-1].finish_reason == "length"
    assert sum(len(output.new_token_ids) for output in after) == 6
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)


def test_a_step_that_raises_beside_other_requests_ends_the_worker(tiny_model, tmp_path):
    """The error cannot be laid on one request: the worker dies (and the front end
    reroutes its requests, charging them the crash)."""
    config, engine = _engine(tiny_model, tmp_path, overlap=False)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(config.inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.bind(config.outbox_address)
    # A PUSH socket with no peer blocks its sender: the front end's end, unread.
    front_end = context.socket(zmq.PULL)
    front_end.connect(config.outbox_address)
    sender = context.socket(zmq.PUSH)
    sender.connect(config.inbox_address)
    for request in (_request("fine", "hello", 40), _request("bad", f"x {MARKER}")):
        sender.send(encode_message(request))
    loop = LoopThread(engine, inbox, outbox)
    loop.start()
    loop.join(timeout=60)
    if loop.is_alive():
        sender.send(encode_message(Shutdown()))
        loop.join(timeout=10)
    for socket in (sender, front_end, inbox, outbox):
        socket.close(0)
    context.term()
    engine.close()
    assert isinstance(loop.error, RuntimeError)
    assert "poisoned request" in str(loop.error)
