"""The HTTP process's side of the worker protocol: route requests to workers, stream tokens back.

One PULL socket receives every worker's outputs and heartbeats; each worker has its own
input socket. A routing policy picks a worker per request (cluster/routing.py). A request
whose worker dies is re-admitted on another with the tokens it already produced appended
to its prompt, so its stream continues; with prefill workers, a request's prompt runs on
one and its decoding on another, its KV passing through the shared KV store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from enum import Enum

import zmq
import zmq.asyncio

from deepwell.serve.cluster.metrics import RoleLatency
from deepwell.serve.cluster.prefix_index import WorkerPrefixes, prompt_block_keys
from deepwell.serve.cluster.routing import RoutingPolicy, WorkerLoad, least_outstanding_tokens
from deepwell.serve.messages import (
    AbortRequest,
    GenerateRequest,
    Heartbeat,
    ModelInfo,
    Shutdown,
    StepOutputs,
    TokenOutput,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
    combine_stats,
    decode_message,
    encode_message,
)

logger = logging.getLogger(__name__)

# A worker silent this long is taken for dead (its heartbeats come every 0.1 s).
HEARTBEAT_TIMEOUT_S = 1.0
_WATCH_INTERVAL_S = 0.05
# The store's record of keys computed anywhere; far more than any worker's pool.
_STORE_KEYS = 1 << 20


class InferenceError(RuntimeError):
    """A request failed in the engine; `status_code` is the HTTP status it maps to."""

    status_code = 503


class EngineUnavailable(InferenceError):
    """No worker can take the request, or its worker went away and none can continue it."""


class RequestRejected(InferenceError):
    """The engine's own validation refused the request."""

    status_code = 400


class DrainRefused(InferenceError):
    """Removing the worker would overload the others, or there is no such worker."""

    status_code = 409


@dataclass(frozen=True)
class DrainResult:
    """How a drained worker left: requests that finished on it, and those moved elsewhere."""

    worker_id: int
    finished: int
    migrated: int
    remaining_utilisation: float


class WorkerRole(Enum):
    """What a worker is asked to do: whole requests, or one side of PD disaggregation."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class _Worker:
    worker_id: int
    address: str
    role: WorkerRole
    socket: zmq.Socket
    stats: WorkerStats = field(default_factory=lambda: WorkerStats(0, 0, 0, 0))
    ready: bool = False
    failure: str | None = None
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)
    prefixes: WorkerPrefixes = field(default_factory=WorkerPrefixes)
    last_seen: float = field(default_factory=time.monotonic)
    # Routing record for /metrics: requests sent here, their prompt tokens and the prefix
    # hit the router expected.
    routed_requests: int = 0
    routed_prompt_tokens: int = 0
    routed_hit_tokens: int = 0

    @property
    def live(self) -> bool:
        return self.ready and self.failure is None


@dataclass
class _Stream:
    request: GenerateRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker: _Worker | None = None
    # Tokens the client has been given; a continuation appends them to the prompt.
    produced: list[int] = field(default_factory=list)
    # True while the prompt runs alone on a prefill worker (max_tokens 1).
    prefilling: bool = False
    dispatched_at: float = 0.0
    last_output_at: float | None = None


@dataclass(frozen=True)
class WorkerView:
    """One worker's state for /metrics and the drain rule."""

    worker_id: int
    role: str
    live: bool
    # Why the worker is out of service (died, refused, silent); None while it serves.
    failure: str | None
    draining: bool
    in_flight: int
    outstanding_tokens: int
    stats: WorkerStats
    routed_requests: int
    routed_prompt_tokens: int
    routed_hit_tokens: int


class EngineClient:
    """Talks to engine workers over ZeroMQ; one instance per HTTP process and event loop."""

    def __init__(
        self,
        outbox_address: str,
        inbox_addresses: list[str],
        *,
        roles: list[WorkerRole] | None = None,
        policy: RoutingPolicy = least_outstanding_tokens,
        block_size: int = 128,
        shared_store: bool = False,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
        join_address: str | None = None,
    ) -> None:
        """`join_address` (tcp://HOST:PORT): where workers started elsewhere connect."""
        # Sends go through plain sockets so an abort can be issued from any cleanup path,
        # without awaiting; receiving is asynchronous.
        self._context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._outbox = self._async_context.socket(zmq.PULL)
        self._outbox.bind(outbox_address)
        if join_address is not None:
            self._outbox.bind(join_address)
        roles = roles or [WorkerRole.MIXED] * len(inbox_addresses)
        # Local workers are 0..N-1; a worker that joins from elsewhere (`deepwell worker
        # --connect`) names itself with a random id and sends its inbox address.
        self._workers = {
            worker_id: _Worker(worker_id, address, role, self._connect(address))
            for worker_id, (address, role) in enumerate(zip(inbox_addresses, roles, strict=True))
        }
        self._policy = policy
        self._block_size = block_size
        self._store = WorkerPrefixes() if shared_store else None
        self._heartbeat_timeout = heartbeat_timeout
        # When the receive loop last found no frame waiting (_watch_heartbeats).
        self._caught_up = time.monotonic()
        self._streams: dict[str, _Stream] = {}
        self._tasks: list[asyncio.Task] = []
        self._all_ready = asyncio.Event()
        self._model: ModelInfo | None = None
        self.latency = RoleLatency()

    def _connect(self, address: str) -> zmq.Socket:
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        return socket

    async def start(self, timeout: float) -> ModelInfo:
        """Wait until every worker has loaded its model; raise if one fails or is too slow.

        Returns the model the workers serve (they must all load the same one).
        """
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watch_heartbeats()),
        ]
        try:
            await asyncio.wait_for(self._all_ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"engine workers not ready after {timeout:.0f} s") from None
        failures = [w.failure for w in self._workers.values() if w.failure is not None]
        if failures:
            raise EngineUnavailable(f"engine worker failed to start: {failures[0]}")
        return self._model

    @property
    def healthy(self) -> bool:
        return any(w.live for w in self._workers.values())

    def stats(self) -> WorkerStats:
        """Scheduler and KV occupancy, and KV reuse counters, summed over live workers."""
        return combine_stats([w.stats for w in self._workers.values() if w.failure is None])

    def workers(self) -> list[WorkerView]:
        return [
            WorkerView(
                w.worker_id,
                w.role.value,
                w.live,
                w.failure,
                w.draining,
                len(w.in_flight),
                self._outstanding(w),
                w.stats,
                w.routed_requests,
                w.routed_prompt_tokens,
                w.routed_hit_tokens,
            )
            for w in self._workers.values()
        ]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Yield the request's outputs until it finishes; closing early aborts it."""
        stream = _Stream(request)
        self._streams[request.request_id] = stream
        try:
            self._dispatch(stream)
            while True:
                output = await stream.queue.get()
                if isinstance(output, InferenceError):
                    raise output
                if output.finish_reason == "error":
                    # The request itself failed in the engine (e.g. its grammar did not compile).
                    raise RequestRejected(output.error or "the engine rejected the request")
                yield output
                if output.finish_reason is not None:
                    return
        finally:
            worker = stream.worker
            if self._forget(request.request_id) and worker is not None and worker.live:
                worker.socket.send(encode_message(AbortRequest([request.request_id])))

    def worker_lost(self, worker_id: int, reason: str) -> None:
        """Take a worker out of service and re-admit its requests on the others."""
        self._remove(worker_id, reason, failed=True)

    def _remove(self, worker_id: int, reason: str, failed: bool) -> None:
        worker = self._workers[worker_id]
        if worker.failure is not None:
            return
        was_ready = worker.ready
        worker.failure = reason
        worker.ready = False
        worker.prefixes.clear()
        # A fresh socket drops frames queued for the dead process, so a restarted worker
        # at the same address does not run requests that moved elsewhere.
        worker.socket.close(linger=0)
        worker.socket = self._connect(worker.address)
        if was_ready and failed:
            logger.warning("engine worker %d lost: %s", worker_id, reason)
        for request_id in list(worker.in_flight):
            stream = self._streams[request_id]
            worker.in_flight.discard(request_id)
            stream.worker = None
            self.latency.rerouted += failed
            try:
                self._dispatch(stream)
            except EngineUnavailable as error:
                self._forget(request_id)
                stream.queue.put_nowait(
                    EngineUnavailable(f"engine worker {worker_id} stopped ({reason}); {error}")
                )
        self._check_all_ready()

    def utilisation_without(self, worker_id: int) -> float:
        """KV blocks in use on every live worker over the blocks of the live workers other
        than `worker_id`: how full the rest would be if it left now (inf if none remain)."""
        live = [w for w in self._workers.values() if w.live]
        used = sum(w.stats.kv_blocks_used for w in live)
        capacity = sum(w.stats.kv_blocks_total for w in live if w.worker_id != worker_id)
        return used / capacity if capacity else float("inf")

    async def drain(self, worker_id: int, max_utilisation: float, timeout: float) -> DrainResult:
        """Take a worker out of service without losing a request (spec/deepinfer.md §5).

        Refused while the remaining workers' utilisation would exceed `max_utilisation`.
        Otherwise no new request goes to the worker; its requests get `timeout` seconds to
        finish there, the rest are re-admitted elsewhere; then the worker is told to exit.
        """
        if worker_id not in self._workers or not self._workers[worker_id].live:
            raise DrainRefused(f"there is no serving engine worker {worker_id}")
        worker = self._workers[worker_id]
        if worker.draining:
            raise DrainRefused(f"engine worker {worker_id} is already draining")
        remaining = self.utilisation_without(worker_id)
        if remaining > max_utilisation:
            raise DrainRefused(
                f"removing engine worker {worker_id} would leave the others at "
                f"{remaining:.0%} utilisation, above the limit of {max_utilisation:.0%}"
            )
        worker.draining = True
        started = len(worker.in_flight)
        deadline = time.monotonic() + timeout
        while worker.in_flight and time.monotonic() < deadline and worker.live:
            await asyncio.sleep(_WATCH_INTERVAL_S)
        migrated = len(worker.in_flight)
        if worker.live:
            self._remove(worker_id, "drained", failed=False)
            worker.socket.send(encode_message(Shutdown()))
        return DrainResult(worker_id, started - migrated, migrated, remaining)

    def worker_restarted(self, worker_id: int) -> None:
        """A lost worker's replacement is loading: it rejoins with its `WorkerReady`."""
        worker = self._workers[worker_id]
        worker.failure = None
        worker.ready = False
        worker.last_seen = time.monotonic()

    async def close(self) -> None:
        """Ask every worker to exit and release the sockets."""
        for worker in self._workers.values():
            if worker.failure is None:
                worker.socket.send(encode_message(Shutdown()))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self._workers.values():
            # Give queued Shutdown frames a moment to leave before the socket goes.
            worker.socket.close(linger=1000)
        self._outbox.close(linger=0)
        self._context.term()
        self._async_context.term()

    def _outstanding(self, worker: _Worker) -> int:
        total = 0
        for request_id in worker.in_flight:
            stream = self._streams[request_id]
            request = stream.request
            if stream.last_output_at is None:
                total += len(request.prompt_token_ids) + len(stream.produced)
            total += (1 if stream.prefilling else request.max_tokens) - len(stream.produced)
        return total

    def _dispatch(self, stream: _Stream) -> None:
        """Send the stream's request, or its continuation, to the worker the policy picks."""
        original = stream.request
        produced = stream.produced
        if produced and original.structured_output is not None:
            # The grammar's state lives in the lost worker; a new one would restart it.
            raise EngineUnavailable("a constrained request cannot continue on another worker")
        prefill = [w for w in self._workers.values() if w.live and not w.draining]
        decode = [w for w in prefill if w.role is not WorkerRole.PREFILL]
        prefill = [w for w in prefill if w.role is WorkerRole.PREFILL]
        # A prompt goes to a prefill worker first when there is one and decoding follows.
        stream.prefilling = bool(
            prefill
            and not produced
            and original.structured_output is None
            and original.max_tokens > 1
        )
        candidates = prefill if stream.prefilling else decode or prefill
        if not candidates:
            raise EngineUnavailable("no engine worker is available")
        prompt = original.prompt_token_ids + produced
        keys = prompt_block_keys(self._root_key(), prompt, self._block_size)
        store_hit = self._store.hit_blocks(keys) * self._block_size if self._store else 0
        loads = [
            WorkerLoad(
                w.worker_id,
                self._outstanding(w),
                w.prefixes.hit_blocks(keys) * self._block_size,
                store_hit,
            )
            for w in candidates
        ]
        chosen = self._policy(len(prompt), loads)
        worker = self._workers[chosen]
        hit = next(load.hit_tokens for load in loads if load.worker_id == chosen)
        worker.routed_requests += 1
        worker.routed_prompt_tokens += len(prompt)
        worker.routed_hit_tokens += max(hit, store_hit)
        worker.prefixes.record(keys, worker.stats.kv_blocks_total)
        if self._store is not None:
            self._store.record(keys, _STORE_KEYS)
        max_tokens = 1 if stream.prefilling else original.max_tokens - len(produced)
        message = replace(original, prompt_token_ids=prompt, max_tokens=max_tokens)
        stream.worker = worker
        stream.dispatched_at = time.perf_counter()
        stream.last_output_at = None
        worker.in_flight.add(original.request_id)
        worker.socket.send(encode_message(message))

    def _root_key(self) -> bytes:
        return bytes.fromhex(self._model.fingerprint) if self._model is not None else b""

    def _forget(self, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        if stream.worker is not None:
            stream.worker.in_flight.discard(request_id)
        return True

    def _deliver(self, worker: _Worker, output: TokenOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None or stream.worker is not worker:
            return  # aborted while the step ran, or moved off a worker taken for dead
        now = time.perf_counter()
        role = worker.role.value
        if output.token_ids:
            if stream.last_output_at is None:
                self.latency.first_token.labels(role).observe(now - stream.dispatched_at)
            else:
                per_token = (now - stream.last_output_at) / len(output.token_ids)
                self.latency.inter_token.labels(role).observe(per_token)
            stream.last_output_at = now
        stream.produced += output.token_ids
        if stream.prefilling and output.finish_reason == "length":
            # The prompt is computed and its blocks are on their way to the store: hand
            # the request to a decode worker, which continues after the first token.
            worker.in_flight.discard(output.request_id)
            stream.queue.put_nowait(replace(output, finish_reason=None))
            self.latency.handed_off += 1
            try:
                self._dispatch(stream)
            except EngineUnavailable as error:
                self._forget(output.request_id)
                stream.queue.put_nowait(error)
            return
        stream.queue.put_nowait(output)
        if output.finish_reason is not None:
            self._forget(output.request_id)

    def _ready(self, worker: _Worker, message: WorkerReady) -> None:
        if self._model is not None and message.model != self._model:
            worker.failure = (
                f"refused: it serves {message.model.name} (fingerprint "
                f"{message.model.fingerprint or 'none'}), the cluster serves {self._model.name} "
                f"(fingerprint {self._model.fingerprint or 'none'})"
            )
            logger.error("engine worker %d %s", worker.worker_id, worker.failure)
            worker.socket.send(encode_message(Shutdown(worker.failure)))
        else:
            self._model = message.model
            worker.ready = True
            worker.failure = None
            worker.stats = message.stats
            if self._all_ready.is_set():
                logger.info("engine worker %d joined", worker.worker_id)
        self._check_all_ready()

    def _check_all_ready(self) -> None:
        workers = self._workers.values()
        if workers and all(w.ready or w.failure is not None for w in workers):
            self._all_ready.set()

    def _join(self, message: WorkerReady) -> _Worker | None:
        """Register a worker that connected on its own; None if it cannot be reached."""
        if not message.inbox_address:
            return None
        worker = _Worker(
            message.worker_id,
            message.inbox_address,
            WorkerRole.MIXED,
            self._connect(message.inbox_address),
        )
        self._workers[worker.worker_id] = worker
        logger.info("engine worker %d connected from %s", worker.worker_id, worker.address)
        return worker

    async def _receive_loop(self) -> None:
        while True:
            message = decode_message(await self._outbox.recv())
            worker = self._workers.get(message.worker_id)
            if worker is None and isinstance(message, WorkerReady):
                worker = self._join(message)
            if worker is None:
                continue  # a worker this front end does not know: nothing to route to it
            worker.last_seen = time.monotonic()
            if not self._outbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._caught_up = worker.last_seen
            if isinstance(message, WorkerReady):
                self._ready(worker, message)
            elif isinstance(message, WorkerFailed):
                self.worker_lost(message.worker_id, message.message)
            elif isinstance(message, StepOutputs) and worker.live:
                worker.stats = message.stats
                for output in message.outputs:
                    self._deliver(worker, output)
                for rejected in message.rejected:
                    stream = self._streams.get(rejected.request_id)
                    if stream is not None and stream.worker is worker:
                        self._forget(rejected.request_id)
                        stream.queue.put_nowait(RequestRejected(rejected.message))
            elif not isinstance(message, (Heartbeat, StepOutputs)):
                raise TypeError(f"frontend cannot handle {type(message).__name__}")

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            # With frames waiting, this process (a busy event loop), not the workers, may
            # have fallen behind: silence counts only up to the last moment every frame
            # sent had been read. (Skipping the check while frames wait starved it: live
            # workers' heartbeats keep the socket busy on a loaded machine.)
            now = time.monotonic()
            if self._outbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                now = self._caught_up
            for worker in self._workers.values():
                silent = now - worker.last_seen
                # Giving up on the only live worker cannot save its requests, and on a
                # starved machine its silence may only be slowness: it is left to finish.
                others = any(w.live for w in self._workers.values() if w is not worker)
                if worker.live and others and silent > self._heartbeat_timeout:
                    self.worker_lost(worker.worker_id, f"no heartbeat for {silent:.1f} s")
