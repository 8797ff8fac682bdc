"""`deepwell serve`: start the engine worker, wait for its model, serve HTTP, stop it all cleanly.

SIGINT / SIGTERM stop accepting connections, let in-flight requests finish for a grace
period (then abort them), tell the workers to exit and wait for them: no orphan processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import uvicorn

from deepwell.serve.api import create_app
from deepwell.serve.engine_client import EngineClient, EngineUnavailable
from deepwell.serve.messages import WorkerConfig, encode_message
from deepwell.serve.model import ServedModel, UnsupportedModel, mock_model, served_model
from deepwell.serve.settings import ServeSettings

logger = logging.getLogger("deepwell.serve")

# Loading a model from a cold disk and building its KV cache can take a while on CPU.
WORKER_READY_TIMEOUT_S = 600.0
WORKER_EXIT_TIMEOUT_S = 10.0
WORKER_WATCH_INTERVAL_S = 0.5


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; return the process exit code."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    settings = ServeSettings(
        api_keys=tuple(args.api_key),
        max_body_bytes=args.max_body_bytes,
        max_pending_requests=args.max_pending_requests,
    )
    try:
        asyncio.run(_serve_mock(args, settings) if args.mock else _serve_model(args, settings))
    except KeyboardInterrupt:  # Ctrl-C before HTTP serving began
        return 130
    except (EngineUnavailable, UnsupportedModel) as error:
        logger.error("%s", error)
        return 1
    return 0


async def _serve_mock(args: argparse.Namespace, settings: ServeSettings) -> None:
    model = mock_model()
    await _serve_http(create_app(model=model, settings=settings), model, args)


async def _serve_model(args: argparse.Namespace, settings: ServeSettings) -> None:
    with tempfile.TemporaryDirectory(prefix="deepwell-") as sockets:
        config = WorkerConfig(
            worker_id=0,
            parent_pid=os.getpid(),
            model_path=args.model,
            inbox_address=f"ipc://{sockets}/worker-0",
            outbox_address=f"ipc://{sockets}/outputs",
            max_num_seqs=args.max_num_seqs,
            memory_gib=args.memory_gib,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
            num_speculative_tokens=args.num_speculative_tokens,
            kv_store_path=args.kv_store,
            kv_store_capacity_gib=args.kv_store_capacity_gib,
            kv_store_ttl_chat_s=args.kv_store_ttl_chat,
            kv_store_ttl_agent_s=args.kv_store_ttl_agent,
            batch_invariant=args.batch_invariant,
            async_scheduling=not args.no_async_scheduling,
            quantize_kv_cache=not args.no_kv_cache_quantization,
            quantization=args.quantization,
            num_threads=args.threads,
        )
        client = EngineClient(config.outbox_address, [config.inbox_address])
        worker = subprocess.Popen(
            [sys.executable, "-m", "deepwell.serve.worker", encode_message(config).hex()]
        )
        watcher = asyncio.create_task(_watch_workers(client, [worker]))
        try:
            info = await client.start(WORKER_READY_TIMEOUT_S)
            model = served_model(info)
            app = create_app(model=model, settings=settings, engine=client)
            await _serve_http(app, model, args)
        finally:
            watcher.cancel()
            await client.close()
            await asyncio.to_thread(_stop_process, worker)


async def _watch_workers(client: EngineClient, workers: list[subprocess.Popen]) -> None:
    while True:
        for worker_id, worker in enumerate(workers):
            if worker.poll() is not None:
                client.worker_lost(worker_id, f"process exited with code {worker.returncode}")
        await asyncio.sleep(WORKER_WATCH_INTERVAL_S)


def _stop_process(worker: subprocess.Popen) -> None:
    try:
        worker.wait(WORKER_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.warning("worker %s did not exit; killing it", worker.pid)
        worker.kill()
        worker.wait()


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the stop signal after shutdown.

    uvicorn re-raises SIGTERM once it has stopped, which would kill this process before it
    stops its workers; here the signal only starts the graceful shutdown.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def _serve_http(app, model: ServedModel, args: argparse.Namespace) -> None:
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=args.shutdown_grace,
    )
    server = _Server(config)
    announcer = asyncio.create_task(_announce(server, model, args))
    try:
        await server.serve()
    finally:
        announcer.cancel()


async def _announce(server: uvicorn.Server, model: ServedModel, args: argparse.Namespace) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    body = (
        f'{{"model": "{model.names[0]}", "messages": '
        '[{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64, '
        # Greedy, so a first try with a 135M model gives its best answer, not a sampled one.
        '"temperature": 0}'
    )
    auth = ' -H "Authorization: Bearer $DEEPWELL_API_KEY"' if args.api_key else ""
    print(
        f"deepwell is serving {', '.join(model.names)} on http://{host}:{args.port}\n"
        f"Try:\n  curl http://{host}:{args.port}/v1/chat/completions"
        f" -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}",
        flush=True,
    )
