"""Engine worker process: receives typed requests over ZeroMQ, steps the engine, streams tokens back.

Run as `python -m deepwell.serve.worker CONFIG` (a hex msgpack `WorkerConfig`), so the HTTP
process never imports torch. Inputs are drained before every step: an abort takes effect
within one engine step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Protocol

import zmq

from deepwell.engine import EngineCore, RequestOutput
from deepwell.engine.layers.decode_kernel import KERNEL_STATES
from deepwell.engine.stats import EngineStats
from deepwell.serve.encoder_worker import ImageEncoderWorker, serve_encoder
from deepwell.serve.images.grid import VisionSpec
from deepwell.serve.inbox import waiting_messages
from deepwell.serve.log_format import configure_logging
from deepwell.serve.messages import (
    HEARTBEAT_INTERVAL_S,
    AbortRequest,
    GenerateRequest,
    Heartbeat,
    ModelInfo,
    RequestRejected,
    Shutdown,
    StepOutputs,
    WorkerConfig,
    WorkerFailed,
    WorkerReady,
    decode_message,
    encode_message,
)
from deepwell.serve.worker_processes import end_own_session, end_with_server
from deepwell.serve.worker_test_hooks import with_test_hooks

# While idle the worker wakes this often to notice a dead parent.
IDLE_POLL_MS = 200
logger = logging.getLogger("deepwell.worker")


class StepEngine(Protocol):
    """What the worker loop needs from an engine: requests in, one step at a time, tokens out.

    `add_request` raises ValueError for a request the engine refuses.
    """

    def add_request(self, request: GenerateRequest) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def key_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Prefix keys of the blocks cached and of those evicted since the last call."""
        ...

    def model_info(self) -> ModelInfo: ...

    def unfinished_request_ids(self) -> list[str]:
        """The requests in the engine (read only when a step has raised)."""
        ...

    def holds_nothing(self) -> bool:
        """No request in the engine and no KV block held: a state it can serve on from."""
        ...


def serve_engine(
    engine: StepEngine,
    worker_id: int,
    inbox: zmq.Socket,
    outbox: zmq.Socket,
    parent_pid: int | None = None,
    inbox_address: str = "",
) -> Shutdown | None:
    """Run the worker loop until a `Shutdown` arrives (returned) or the parent process is gone.

    `inbox_address` is announced in `WorkerReady` for a front end that did not start us.
    """
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_stats = engine.stats()
    ready = WorkerReady(worker_id, engine.model_info(), last_stats, inbox_address)
    outbox.send(encode_message(ready))
    while True:
        busy = engine.has_unfinished()
        poller.poll(0 if busy else IDLE_POLL_MS)
        rejected = []
        for message in waiting_messages(inbox):
            if isinstance(message, Shutdown):
                return message
            if isinstance(message, GenerateRequest):
                try:
                    engine.add_request(message)
                except ValueError as error:
                    rejected.append(RequestRejected(message.request_id, str(error)))
                except Exception as error:  # a bug met taking this one request in
                    engine.abort([message.request_id])
                    rejected.append(_ended(message.request_id, error))
            elif isinstance(message, AbortRequest):
                engine.abort(message.request_ids)
            else:
                raise TypeError(f"worker cannot handle {type(message).__name__}")
        if parent_pid is not None and os.getppid() != parent_pid:
            return None
        outputs = []
        if engine.has_unfinished():
            # A try block costs nothing until it raises (CPython 3.11's exception tables).
            try:
                outputs = engine.step()
            except Exception as error:
                rejected.append(_failed_in_step(engine, error))
        stats = engine.stats()
        # What a step cached and evicted goes out with its outputs, one frame per step.
        cached, evicted = engine.key_changes()
        if outputs or rejected or cached or evicted or stats != last_stats:
            message = StepOutputs(worker_id, outputs, rejected, stats, cached, evicted)
            outbox.send(encode_message(message))
            last_stats = stats


def _failed_in_step(engine: StepEngine, error: Exception) -> RequestRejected:
    """A step raised: with one request in the engine it is that request's, which fails
    while the worker serves on, if ending it leaves the engine holding nothing. Otherwise
    the error is the worker's: it propagates, the worker exits, and the front end
    reroutes its requests, charging the crash to them (cluster/request_router.py)."""
    request_ids = engine.unfinished_request_ids()
    if len(request_ids) != 1:
        raise error
    engine.abort(request_ids)
    if not engine.holds_nothing():
        raise error
    return _ended(request_ids[0], error)


def _ended(request_id: str, error: Exception) -> RequestRejected:
    """The report of a request ended because the engine raised on it: its client gets a
    500 naming its request id; the traceback goes to this worker's log only."""
    logger.error("engine failed on request %s; it was ended", request_id, exc_info=error)
    return RequestRejected(
        request_id, f"the engine failed on this request ({type(error).__name__})", internal=True
    )


class EngineCoreAdapter:
    """`StepEngine` over deepwell's `EngineCore`: protocol messages ↔ engine calls."""

    def __init__(self, config: WorkerConfig) -> None:
        self._args = config.engine
        self._core = EngineCore(self._args)
        self._core.kv.watch_keys()

    def add_request(self, request: GenerateRequest) -> None:
        self._core.provide_image_embeddings(request.image_embeddings)
        self._core.add_request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling,
            request.cache_class,
            request.images,
        )

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._core.abort(request_id)

    def has_unfinished(self) -> bool:
        # An expert-parallel rank steps while it lives: its peers' steps need it in every
        # MoE layer's exchange (an idle group ticks slowly, parallel/lockstep.py).
        return self._core.lockstep is not None or self._core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        return self._core.step()

    def stats(self) -> EngineStats:
        return self._core.stats()

    def unfinished_request_ids(self) -> list[str]:
        return list(self._core.requests)

    def holds_nothing(self) -> bool:
        stats = self._core.stats()
        held = (stats.running, stats.waiting, stats.kv_blocks_used)
        return not self._core.requests and held == (0, 0, 0)

    def prompt_text(self, token_ids: list[int]) -> str:
        return self._core.tokenizer.decode(token_ids)

    def key_changes(self) -> tuple[list[bytes], list[bytes]]:
        return self._core.kv.take_key_changes()

    def close(self) -> None:
        """Write out queued KV store blocks; the next worker may want them."""
        self._core.close()

    def model_info(self) -> ModelInfo:
        core = self._core
        return ModelInfo(
            name=core.model_name,
            architecture=core.architecture,
            context_limit=core.max_model_len,
            tokenizer_json=core.tokenizer.to_str(),
            chat_template=core.chat_template,
            eos_token_ids=sorted(core.eos_token_ids),
            dtype=self._args.dtype_choice.dtype,
            requested_dtype=self._args.dtype_choice.requested,
            dtype_reason=self._args.dtype_choice.reason,
            bos_token_id=core.bos_token_id,
            fingerprint=core.kv.root_key.hex() if core.kv.root_key is not None else "",
            vision=self._vision(),
        )

    def _vision(self) -> VisionSpec | None:
        """How the HTTP process prepares images for this engine: None unless the engine
        built a vision tower, so that no image reaches an engine that cannot see it."""
        if self._core.intake.image_encoder is None:
            return None
        config = json.loads((Path(self._args.model) / "config.json").read_text())
        return VisionSpec.from_config(config)


def send_heartbeats(
    context: zmq.Context, address: str, worker_id: int, stop: threading.Event
) -> None:
    """Tell the frontend every `HEARTBEAT_INTERVAL_S` that this process lives; its own socket,
    since ZeroMQ sockets are not shared across threads."""
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            # A frontend that is not reading decides on its own what that means.
            with contextlib.suppress(zmq.Again):
                beat = Heartbeat(worker_id, dict(KERNEL_STATES))
                socket.send(encode_message(beat), zmq.NOBLOCK)
    finally:
        socket.close()


def _exit_on_sigterm(_sig: int, _frame: object) -> None:
    """SIGTERM (the launcher's, to a worker that is not reading its inbox, or Linux's when the
    server died) as an exception, not the default exit on the spot: a kernel build under way
    releases its build locks on the way out (engine/layers/kernel_build_lock.py), and what its
    compiler left half-written has no entry in ninja's log, so the next build redoes it. The
    build's own processes are told too (the launcher signals the whole session, Linux only
    the worker)."""
    end_own_session()
    raise SystemExit(128 + signal.SIGTERM)


def main(config: WorkerConfig) -> None:
    """Process entry point: load the engine, then serve it until told to stop."""
    # The parent owns shutdown: it finishes or aborts in-flight requests, then sends
    # `Shutdown`. A Ctrl-C reaching the whole process group must not kill us first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if config.parent_pid:  # 0: started on its own (`deepwell worker`) or by Ray
        end_with_server(config.parent_pid)
    configure_logging(config.log_level, config.log_format)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(config.inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 1000)
    outbox.connect(config.outbox_address)
    stop_heartbeats = threading.Event()
    heartbeats = threading.Thread(
        target=send_heartbeats,
        args=(context, config.outbox_address, config.worker_id, stop_heartbeats),
        daemon=True,
    )
    try:
        if config.role == "encoder":
            engine, loop = ImageEncoderWorker(config), serve_encoder
        else:
            engine, loop = with_test_hooks(EngineCoreAdapter(config)), serve_engine
        heartbeats.start()
        try:
            address = inbox.getsockopt(zmq.LAST_ENDPOINT).decode()
            parent = config.parent_pid or None  # 0: started on its own (`deepwell worker`)
            stop = loop(engine, config.worker_id, inbox, outbox, parent, address)
            if loop is serve_engine:
                # The front end's aborts came before its Shutdown, so every request it
                # ended has given its blocks back by now.
                stats = engine.stats()
                logger.info(
                    "engine worker %d stopped: %d requests unfinished, KV blocks held: %d",
                    config.worker_id,
                    stats.running + stats.waiting,
                    stats.kv_blocks_used,
                )
        finally:
            engine.close()
        if stop is not None and stop.refusal:
            raise SystemExit(f"deepwell worker: the front end refused this worker: {stop.refusal}")
    except Exception as error:  # the frontend must learn why its worker is gone
        message = f"{type(error).__name__}: {error}"
        outbox.send(encode_message(WorkerFailed(config.worker_id, message)))
        raise
    finally:
        stop_heartbeats.set()
        if heartbeats.is_alive():
            heartbeats.join()
        inbox.close(linger=0)
        outbox.close()
        context.term()


if __name__ == "__main__":
    main(decode_message(bytes.fromhex(sys.argv[1])))
