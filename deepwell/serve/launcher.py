"""`deepwell serve`: listen at once, start the engine workers, serve their model once it is
up, stop it all cleanly.

SIGINT / SIGTERM drain (serve/graceful_shutdown.py), tell the workers to exit and wait for
them; a worker still loading is terminated at once (serve/worker_processes.py): no orphan
processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from deepwell.cpu_dtype import select_dtype
from deepwell.recipe.encoding.chat_template import ChatTemplateError, compile_template
from deepwell.serve.api import create_app
from deepwell.serve.cluster.assembly import Cluster, assemble_cluster
from deepwell.serve.cluster.inference_errors import EngineUnavailable
from deepwell.serve.cluster.options import worker_roles
from deepwell.serve.cluster.routing import POLICIES
from deepwell.serve.cluster.worker_pool import Worker, WorkerPool, WorkerRole
from deepwell.serve.graceful_shutdown import GracefulShutdown
from deepwell.serve.log_format import configure_logging
from deepwell.serve.messages import WorkerConfig
from deepwell.serve.model import (
    ServedModel,
    UnsupportedModel,
    mock_model,
    renamed,
    served_model,
)
from deepwell.serve.settings import (
    API_KEY_ENV,
    ServeSettings,
    api_keys,
    image_settings,
    model_path,
)
from deepwell.serve.start_gate import StartGate
from deepwell.serve.worker_processes import kill_worker, start_worker, stop_worker
from deepwell.settings.flags import engine_args_from, given
from deepwell.settings.parallel import ParallelConfig

logger = logging.getLogger("deepwell.serve")

# Loading a model from a cold disk and building its KV cache can take a while on CPU.
WORKER_READY_TIMEOUT_S = 600.0
# After the drain, how long uvicorn waits for open connections before closing them.
HTTP_CLOSE_TIMEOUT_S = 5.0
# A killed worker is noticed within this (its heartbeats would take a second).
WORKER_WATCH_INTERVAL_S = 0.1


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; return the process exit code."""
    configure_logging(args.log_level, args.log_format)
    settings = ServeSettings(
        api_keys=api_keys(args.api_key, os.environ),
        max_body_bytes=args.max_body_bytes,
        max_pending_requests=args.max_pending_requests,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout,
        drain_max_utilisation=args.drain_max_utilisation,
        drain_timeout_s=args.drain_timeout,
        key_tokens_per_minute=args.key_tokens_per_minute,
        default_seed=args.seed,
        playground=not args.no_playground,
        docs=not args.disable_docs,
        images=image_settings(args),
        responses_store=args.responses_store,
        responses_ttl_s=args.responses_ttl,
        responses_max=args.responses_max,
        allowed_origins=tuple(args.allowed_origins),
        log_prompts=args.log_prompts,
    )
    try:
        model = model_path(args)  # two disagreeing models stop here, before anything starts
        refusal = _memory_refusal(args, model)
        if refusal is not None:
            logger.error("%s", refusal)
            return 1
        asyncio.run(_serve_mock(args, settings) if args.mock else _serve_model(args, settings))
    except KeyboardInterrupt:  # Ctrl-C before HTTP serving began
        return 130
    except (EngineUnavailable, UnsupportedModel, ValueError) as error:
        logger.error("%s", error)
        return 1
    return 0


def _memory_refusal(args: argparse.Namespace, model: str | None) -> str | None:
    """Why the model cannot fit --memory-gib (or why its config.json is unusable), from that
    file alone, before any worker starts and loads weights; None when it fits or the planner
    cannot tell (engine/plan/)."""
    if args.mock or args.expert_parallel:  # a rank then holds only its share of the experts
        return None
    # Imported here: the front end of `serve --mock` loads nothing of the engine.
    from deepwell.engine.errors import MemoryBudgetError, ModelLoadError
    from deepwell.engine.plan import refuse_unfit

    try:
        refuse_unfit(
            model,
            args.memory_gib,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            compute_dtype=select_dtype(args.dtype).dtype,
        )
    except (MemoryBudgetError, ModelLoadError) as error:
        return str(error)
    return None


async def _serve_mock(args: argparse.Namespace, settings: ServeSettings) -> None:
    model = mock_model()
    if args.served_model_name:
        model = renamed(model, args.served_model_name)

    async def start() -> tuple[FastAPI, ServedModel]:
        return create_app(model=model, settings=settings), model

    await _serve_http(start, settings, args)


def _read_chat_template(path: str | None) -> str | None:
    """`--chat-template`'s text, compiled once here so a broken one stops us before loading."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
        compile_template(text)
    except (OSError, UnicodeDecodeError, ChatTemplateError) as error:
        raise UnsupportedModel(f"--chat-template {path}: {error}") from None
    return text


async def _serve_model(args: argparse.Namespace, settings: ServeSettings) -> None:
    chat_template = _read_chat_template(args.chat_template)
    try:
        roles = worker_roles(args)
    except ValueError as error:
        raise EngineUnavailable(str(error)) from None
    on_ray = args.cluster.kind == "ray"
    ray_workers = _ray_workers_module() if on_ray else None
    join_address = _join_ray(args, ray_workers) if on_ray else args.worker_address
    with tempfile.TemporaryDirectory(prefix="deepwell-") as sockets:
        outbox = f"ipc://{sockets}/outputs"
        configs = [
            worker_config(
                args,
                worker_id,
                "" if on_ray else f"ipc://{sockets}/worker-{worker_id}",
                outbox,
                0 if on_ray else os.getpid(),
                role,
            )
            for worker_id, role in enumerate(roles)
        ]
        cluster = _assemble(args, settings, outbox, configs, roles, join_address)
        started = time.monotonic()
        serving = asyncio.Event()
        if on_ray:
            configs = [
                dataclasses.replace(config, outbox_address=cluster.pool.join_address)
                for config in configs
            ]
            placement = ray_workers.RayPlacement(
                args.ray_placement, args.ray_cpus_per_worker, args.ray_max_restarts
            )
            actors = ray_workers.RayWorkers(configs, placement)
            logger.info(
                "starting %d engine worker(s) on Ray (%s placement): loading %s",
                len(configs),
                actors.strategy,
                _model_name(args),
            )
            workers = []
            watcher = None
        else:
            workers = [start_worker(config) for config in configs]
            logger.info("starting %d engine worker(s): loading %s", len(workers), _model_name(args))
            watcher = asyncio.create_task(_watch_workers(cluster.pool, configs, workers, serving))

        async def start() -> tuple[FastAPI, ServedModel]:
            nonlocal watcher
            if on_ray:
                await actors.start(WORKER_READY_TIMEOUT_S)
                watcher = asyncio.create_task(actors.supervise(cluster.pool, serving))
            info = await cluster.pool.start(WORKER_READY_TIMEOUT_S)
            serving.set()
            logger.info(
                "engine worker(s) ready in %.1f s; computing in %s (--dtype %s: %s)",
                time.monotonic() - started,
                info.dtype,
                info.requested_dtype,
                info.dtype_reason,
            )
            model = served_model(info, chat_template, args.tool_call_parser)
            if args.served_model_name:
                model = renamed(model, args.served_model_name)
            app = create_app(model=model, settings=settings, cluster=cluster, model_info=info)
            return app, model

        try:
            await _serve_http(start, settings, args)
        finally:
            if watcher is not None:
                watcher.cancel()
            await _close_workers(cluster.pool, workers)
            if on_ray:
                await asyncio.to_thread(actors.stop)
                ray_workers.disconnect()


def _join_ray(args: argparse.Namespace, ray_workers) -> str:
    """Join the Ray cluster `--cluster` names; the address Ray's actors connect to from their
    nodes, as `deepwell worker --connect` does."""
    if args.nnodes > 1:
        raise EngineUnavailable(
            "on Ray this serve starts every data-parallel rank and Ray places them: give "
            "--data-parallel-size alone, not --nnodes"
        )
    node_address = ray_workers.connect(args.cluster)
    return args.worker_address or f"tcp://{node_address}:*"


def _assemble(
    args: argparse.Namespace,
    settings: ServeSettings,
    outbox: str,
    configs: list[WorkerConfig],
    roles: list[str],
    join_address: str | None,
) -> Cluster:
    return assemble_cluster(
        outbox,
        [config.inbox_address for config in configs],
        roles=[WorkerRole(role) for role in roles],
        policy=POLICIES[args.routing_policy](),
        block_size=configs[0].engine.block_size,
        shared_store=configs[0].engine.kv_store_path is not None,
        heartbeat_timeout=args.heartbeat_timeout,
        hung_timeout=args.hung_worker_timeout,
        join_address=join_address,
        eviction_reports=args.eviction_reports,
        request_timeout_s=settings.request_timeout_s,
        crashes_per_request=args.worker_crashes_per_request,
    )


def _ray_workers_module():
    """serve/cluster/ray_workers.py, which needs Ray (the `ray` extra)."""
    try:
        from deepwell.serve.cluster import ray_workers
    except ImportError as error:
        raise EngineUnavailable(
            f"--cluster ray needs Ray ({error}): pip install 'deepwell[ray]'"
        ) from None
    return ray_workers


def _model_name(args: argparse.Namespace) -> str:
    model = model_path(args)
    return model if model is not None else "the embedded SmolLM2-135M-Instruct"


def worker_config(
    args: argparse.Namespace,
    worker_id: int,
    inbox_address: str,
    outbox_address: str,
    parent_pid: int,
    role: str = "mixed",
) -> WorkerConfig:
    """A worker's configuration from `deepwell serve`'s options (`deepwell worker` shares them)."""
    parallel = ParallelConfig(**given(args, ParallelConfig))
    if parallel.data_parallel_size > 1:
        # Worker i of this machine is global rank node_rank * (ranks per node) + i.
        parallel = parallel.for_rank(parallel.local_ranks()[worker_id])
    return WorkerConfig(
        worker_id=worker_id,
        parent_pid=parent_pid,
        inbox_address=inbox_address,
        outbox_address=outbox_address,
        engine=engine_args_from(args, model=model_path(args), parallel=parallel),
        log_level=args.log_level,
        log_format=args.log_format,
        role=role,
    )


async def _watch_workers(
    pool: WorkerPool,
    configs: list[WorkerConfig],
    workers: list[subprocess.Popen],
    serving: asyncio.Event,
) -> None:
    """Report dead workers to the pool; once serving, restart them so they rejoin.

    A worker the pool has given up on (no heartbeat) is killed first: it may be hung.
    Before serving, a dead worker is a failed start, not restarted.
    """
    while True:
        for worker_id, worker in enumerate(workers):
            known = pool.workers[worker_id]
            if worker.poll() is None:
                if serving.is_set() and known.failure is not None and not known.draining:
                    kill_worker(worker)
                continue
            if known.draining:
                continue  # drained on purpose: it stays out
            # The pool hands the lost worker's requests to the router, which re-admits them.
            pool.remove(worker_id, f"process exited with code {worker.returncode}", failed=True)
            if serving.is_set():
                logger.warning("restarting engine worker %d", worker_id)
                workers[worker_id] = start_worker(configs[worker_id])
                pool.restarted(worker_id)
        await asyncio.sleep(WORKER_WATCH_INTERVAL_S)


async def _close_workers(pool: WorkerPool, workers: list[subprocess.Popen]) -> None:
    """Closes the pool (its `Shutdown` to every worker that reads its inbox), then stops
    the worker processes together: those that read it by their own exit, the others at once."""
    reading = [_reads_inbox(pool.workers[worker_id]) for worker_id in range(len(workers))]
    await pool.close()
    await asyncio.gather(
        *(
            asyncio.to_thread(stop_worker, worker, reads)
            for worker, reads in zip(workers, reading, strict=True)
        )
    )


def _reads_inbox(worker: Worker) -> bool:
    """Whether a worker takes its `Shutdown` (a drained one has it already, and may still
    be writing out its KV store blocks)."""
    return worker.live or worker.draining


class _Server(uvicorn.Server):
    """uvicorn's server, whose stop signals start a graceful shutdown (`on_signal`) instead
    of closing the listener at once (and re-raising the signal once stopped, which would
    kill this process before it stops its workers)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = [signal.SIGINT, signal.SIGTERM]
        # A closed terminal's SIGHUP reaches this process alone (the workers lead sessions of
        # their own): it stops the server too, unless it was told to ignore it (nohup).
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            handled.append(signal.SIGHUP)
        previous = {sig: signal.signal(sig, self._signalled) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _signalled(self, _sig: int, _frame: object) -> None:
        self._on_signal()


async def _serve_http(
    start: Callable[[], Awaitable[tuple[FastAPI, ServedModel]]],
    settings: ServeSettings,
    args: argparse.Namespace,
) -> None:
    """Listen at once through the start gate; `start` builds the app, which then serves
    until a stop signal has drained it. A signal before `start` ends stops the start."""
    gate = StartGate()
    config = uvicorn.Config(
        gate,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # Our handler formats uvicorn's lines too (--log-format); the request log replaces
        # uvicorn's access log.
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=HTTP_CLOSE_TIMEOUT_S,
    )

    def stop() -> None:
        server.should_exit = True

    shutdown = GracefulShutdown(
        args.shutdown_timeout, lambda: gate.app.state.parts if gate.app else None, stop
    )
    server = _Server(config, shutdown.signal)
    serving = asyncio.create_task(server.serve())
    stopper = asyncio.create_task(shutdown.run())
    starting = asyncio.create_task(start())
    announcer = None
    try:
        await asyncio.wait({starting, serving}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # stopped (a signal) before the model was up
            return
        try:
            app, model = starting.result()
        except BaseException:
            stop()
            raise
        await gate.open(app)
        announcer = asyncio.create_task(_announce(server, model, bool(settings.api_keys), args))
        await serving
    finally:
        for task in (starting, stopper, announcer):
            if task is not None:
                task.cancel()
        await asyncio.gather(serving, starting, stopper, return_exceptions=True)


async def _announce(
    server: uvicorn.Server, model: ServedModel, keyed: bool, args: argparse.Namespace
) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    body = (
        f'{{"model": "{model.names[0]}", "messages": '
        '[{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64, '
        # Greedy, so a first try with a 135M model gives its best answer, not a sampled one.
        '"temperature": 0}'
    )
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if keyed else ""
    playground = "" if args.no_playground else f"\nOr open http://{host}:{args.port}/playground"
    banner = (
        f"deepwell is serving {', '.join(model.names)} on http://{host}:{args.port}\n"
        f"Try:\n  curl http://{host}:{args.port}/v1/chat/completions"
        f" -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}{playground}"
    )
    if args.log_format == "json":  # every line of the output stays one JSON object
        logger.info("%s", banner)
    else:
        print(banner, flush=True)
