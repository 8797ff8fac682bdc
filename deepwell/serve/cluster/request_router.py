"""Where each request runs: the routing policy over the prefix index, PD hand-off, failover
and the drain rule; `generate` submits a request and streams its outputs (closing aborts it).

A request whose worker dies is re-admitted on another with the tokens it already produced
appended to its prompt, so its stream continues; with prefill workers, a request's prompt
runs on one and its decoding on another, its KV passing through the shared KV store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from deepwell.engine.kv.prefix_hash import prompt_block_keys
from deepwell.engine.multimodal import image_spans
from deepwell.engine.outputs import RequestOutput
from deepwell.engine.stats import EngineStats
from deepwell.serve.cluster.inference_errors import (
    DeadlineExceeded,
    DrainRefused,
    EngineFailedRequest,
    EngineUnavailable,
    RequestCrashedWorkers,
    RequestRejected,
)
from deepwell.serve.cluster.metrics import RoleLatency
from deepwell.serve.cluster.options import WORKER_CRASHES_PER_REQUEST
from deepwell.serve.cluster.prefix_index import WorkerPrefixes
from deepwell.serve.cluster.routing import RoutingPolicy, WorkerLoad
from deepwell.serve.cluster.stream_table import Stream, StreamTable
from deepwell.serve.cluster.worker_pool import WATCH_INTERVAL_S, Worker, WorkerPool, WorkerRole
from deepwell.serve.messages import (
    AbortRequest,
    EncodeImages,
    GenerateRequest,
    ImagesEncoded,
    Shutdown,
    StepOutputs,
    encode_message,
)
from deepwell.serve.request_log import current_request_id, note

logger = logging.getLogger(__name__)

# The store's record of keys computed anywhere; far more than any worker's pool.
_STORE_KEYS = 1 << 20


@dataclass(frozen=True)
class DrainResult:
    """How a drained worker left: requests that finished on it, and those moved elsewhere."""

    worker_id: int
    finished: int
    migrated: int
    remaining_utilisation: float


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
    stats: EngineStats
    routed_requests: int
    routed_prompt_tokens: int
    routed_hit_tokens: int
    # Times the worker's process was started again after it was lost.
    restarts: int = 0
    # Its native kernels by name: "building", "loaded" or "unavailable" (worker heartbeats).
    kernels: dict[str, str] = field(default_factory=dict)


class RequestRouter:
    """Sends requests to the pool's workers and moves them when a worker leaves.

    `shared_store`: workers share a KV store, so a prefix computed anywhere is a hit.
    `eviction_reports`: the prefix index follows the blocks workers report cached and
    evicted (off: it knows only what was sent where, capped at each pool's size).
    `request_timeout_s`: each request's deadline, past which it is aborted on its worker
    and its stream fails, whether or not its reader is keeping up.
    `crashes_per_request`: worker crashes charged to one request before it is failed
    (`RequestCrashedWorkers`) instead of rerouted: a request that kills every worker it
    reaches is stopped after that many, while the others on those workers move on.
    """

    def __init__(
        self,
        pool: WorkerPool,
        streams: StreamTable,
        policy: RoutingPolicy,
        block_size: int,
        shared_store: bool,
        latency: RoleLatency,
        eviction_reports: bool = True,
        request_timeout_s: float | None = None,
        crashes_per_request: int = WORKER_CRASHES_PER_REQUEST,
    ) -> None:
        self._pool = pool
        self._crashes_per_request = crashes_per_request
        self._eviction_reports = eviction_reports
        self._request_timeout_s = request_timeout_s
        # Requests aborted at their deadline, for /metrics.
        self.deadline_expiries = 0
        self._streams = streams
        self._policy = policy
        self._block_size = block_size
        self._store = WorkerPrefixes() if shared_store else None
        self._latency = latency

    def views(self) -> list[WorkerView]:
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
                w.restarts,
                dict(w.kernels),
            )
            for w in self._pool.workers.values()
        ]

    def num_waiting(self) -> int:
        """Requests sent to a worker that have not had an output since (queued there, or in
        their prefill): what --max-waiting-requests bounds."""
        return self._streams.num_waiting()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; closing early aborts it."""
        stream = self._streams.open(request)
        stream.client_request_id = current_request_id()
        expiry = None
        if self._request_timeout_s is not None:
            expiry = asyncio.get_running_loop().call_later(
                self._request_timeout_s, self._expire, stream
            )
        try:
            self.dispatch(stream)
            async for output in self._streams.outputs(stream):
                yield output
        finally:
            if expiry is not None:
                expiry.cancel()
            self._abort(stream)

    def _abort(self, stream: Stream) -> None:
        """Forget a stream and abort its request on its worker, if it was still running."""
        worker = stream.worker
        request_id = stream.request.request_id
        if self._streams.forget(request_id) and worker is not None and worker.live:
            worker.socket.send(encode_message(AbortRequest([request_id])))

    def _expire(self, stream: Stream) -> None:
        """The request's deadline passed: free its blocks now, even if its client is not
        reading (its generator may sit unresumed behind a slow SSE reader)."""
        if self._streams.on(stream.worker, stream.request.request_id) is not stream:
            return
        self.deadline_expiries += 1
        self._abort(stream)
        stream.queue.put_nowait(
            DeadlineExceeded(
                f"the request ran past its deadline of {self._request_timeout_s:g} s "
                "(--request-timeout) and was stopped"
            )
        )

    def dispatch(self, stream: Stream) -> None:
        """Send the stream's request, or its continuation, to the worker the policy picks."""
        original = stream.request
        produced = stream.produced
        live = [w for w in self._pool.workers.values() if w.live and not w.draining]
        encoders = [w for w in live if w.role is WorkerRole.ENCODER]
        if original.images and not original.image_embeddings and encoders:
            # E before P: while no encoder worker is live, the engine encodes its own.
            self._encode(stream, encoders)
            return
        engines = [w for w in live if w.role is not WorkerRole.ENCODER]
        decode = [w for w in engines if w.role is not WorkerRole.PREFILL]
        prefill = [w for w in engines if w.role is WorkerRole.PREFILL]
        # A prompt goes to a prefill worker first when there is one and decoding follows.
        stream.prefilling = bool(
            prefill
            and not produced
            and original.sampling.structured_output is None
            and original.sampling.max_tokens > 1
        )
        candidates = prefill if stream.prefilling else decode or prefill
        if not candidates:
            raise EngineUnavailable("no engine worker is available")
        prompt = original.prompt_token_ids + produced
        worker = self._choose(candidates, prompt, self._image_spans(original))
        max_tokens = 1 if stream.prefilling else original.sampling.max_tokens - len(produced)
        message = original.continuation(produced, max_tokens)
        stream.worker = worker
        # Heard only in the request's own task: a failover's dispatch runs in the pool's.
        note(worker=worker.worker_id)
        stream.dispatched_at = time.perf_counter()
        stream.last_output_at = None
        worker.in_flight.add(original.request_id)
        worker.socket.send(encode_message(message))

    def _encode(self, stream: Stream, encoders: list[Worker]) -> None:
        """Send the request's images to the encoder worker with the fewest requests; the
        request goes on to an engine worker with their embeddings (`images_encoded`)."""
        request = stream.request
        worker = min(encoders, key=lambda w: (len(w.in_flight), w.worker_id))
        worker.routed_requests += 1
        stream.worker = worker
        stream.prefilling = False
        stream.dispatched_at = time.perf_counter()
        stream.last_output_at = None
        worker.in_flight.add(request.request_id)
        worker.socket.send(encode_message(EncodeImages(request.request_id, list(request.images))))

    def images_encoded(self, worker: Worker, message: ImagesEncoded) -> None:
        stream = self._streams.on(worker, message.request_id)
        if stream is None:
            return
        worker.in_flight.discard(message.request_id)
        if message.error:
            self._streams.fail(stream, RequestRejected(message.error))
            return
        stream.request = replace(stream.request, image_embeddings=tuple(message.embeddings))
        try:
            self.dispatch(stream)
        except EngineUnavailable as error:
            self._streams.fail(stream, error)

    def _image_spans(self, request: GenerateRequest) -> tuple[tuple[int, int, str], ...]:
        """The request's image spans as the engine keys its blocks by them (kv/prefix_hash.py):
        two prompts that differ only in an image share no block."""
        vision = self._pool.model.vision if self._pool.model is not None else None
        if not request.images or vision is None:
            return ()
        return image_spans(request.images, vision.downsample_ratio)

    def _choose(
        self,
        candidates: list[Worker],
        prompt: list[int],
        spans: tuple[tuple[int, int, str], ...] = (),
    ) -> Worker:
        """The policy's pick given each candidate's load and prefix hit; records the route."""
        keys = prompt_block_keys(self._root_key(), prompt, self._block_size, spans)
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
        worker = self._pool.workers[chosen]
        hit = next(load.hit_tokens for load in loads if load.worker_id == chosen)
        worker.routed_requests += 1
        worker.routed_prompt_tokens += len(prompt)
        worker.routed_hit_tokens += max(hit, store_hit)
        worker.prefixes.record(keys, worker.stats.kv_blocks_total)
        if self._store is not None:
            self._store.record(keys, _STORE_KEYS)
        return worker

    def step_outputs(self, worker: Worker, message: StepOutputs) -> None:
        if self._eviction_reports:
            # Disjoint, so the order does not matter; a key sent here and evicted from an
            # older copy comes back with the report that the worker cached it again.
            worker.prefixes.forget(message.evicted_keys)
            worker.prefixes.record(message.cached_keys, worker.stats.kv_blocks_total)
        for output in message.outputs:
            self._deliver(worker, output)
        for rejected in message.rejected:
            stream = self._streams.on(worker, rejected.request_id)
            if stream is None:
                continue
            if rejected.internal:
                request_id = stream.client_request_id or rejected.request_id
                message_text = f"{rejected.message} (request id {request_id})"
                self._streams.fail(stream, EngineFailedRequest(message_text))
            else:
                self._streams.fail(stream, RequestRejected(rejected.message))

    def _deliver(self, worker: Worker, output: RequestOutput) -> None:
        stream = self._streams.on(worker, output.request_id)
        if stream is None:
            return
        self._streams.record(stream, output, worker.role.value)
        if stream.prefilling and output.finish_reason == "length":
            # The prompt is computed and its blocks are on their way to the store: hand
            # the request to a decode worker, which continues after the first token.
            worker.in_flight.discard(output.request_id)
            stream.queue.put_nowait(replace(output, finish_reason=None))
            self._latency.handed_off += 1
            try:
                self.dispatch(stream)
            except EngineUnavailable as error:
                self._streams.fail(stream, error)
            return
        self._streams.deliver(stream, output)

    def worker_removed(self, worker: Worker, reason: str, failed: bool) -> None:
        """Re-admit the requests of a worker that left on the others; a crash is charged
        to its suspects first, and a request charged `crashes_per_request` times fails."""
        streams = [self._streams[request_id] for request_id in worker.in_flight]
        for stream in _charged(streams) if failed else []:
            stream.crashes += 1
        for stream in streams:
            worker.in_flight.discard(stream.request.request_id)
            stream.worker = None
            if stream.crashes >= self._crashes_per_request:
                self._quarantine(stream, worker, reason)
                continue
            self._latency.rerouted += failed
            try:
                self.dispatch(stream)
            except EngineUnavailable as error:
                message = f"engine worker {worker.worker_id} stopped ({reason}); {error}"
                self._streams.fail(stream, EngineUnavailable(message))

    def _quarantine(self, stream: Stream, worker: Worker, reason: str) -> None:
        request_id = stream.client_request_id or stream.request.request_id
        self._latency.quarantined += 1
        logger.error(
            "request %s failed, not rerouted: charged with %d worker crashes, the last "
            "engine worker %d (%s)",
            request_id,
            stream.crashes,
            worker.worker_id,
            reason,
        )
        message = (
            f"this request crashed {stream.crashes} engine workers and is not retried "
            f"(request id {request_id})"
        )
        self._streams.fail(stream, RequestCrashedWorkers(message))

    def utilisation_without(self, worker_id: int) -> float:
        """KV blocks in use on every live worker over the blocks of the live workers other
        than `worker_id`: how full the rest would be if it left now (inf if none remain)."""
        live = [w for w in self._pool.workers.values() if w.live]
        used = sum(w.stats.kv_blocks_used for w in live)
        capacity = sum(w.stats.kv_blocks_total for w in live if w.worker_id != worker_id)
        return used / capacity if capacity else float("inf")

    async def drain(self, worker_id: int, max_utilisation: float, timeout: float) -> DrainResult:
        """Take a worker out of service without losing a request (spec/deepinfer.md §5).

        Refused while the remaining workers' utilisation would exceed `max_utilisation`.
        Otherwise no new request goes to the worker; its requests get `timeout` seconds to
        finish there, the rest are re-admitted elsewhere; then the worker is told to exit.
        """
        workers = self._pool.workers
        if worker_id not in workers or not workers[worker_id].live:
            raise DrainRefused(f"there is no serving engine worker {worker_id}")
        worker = workers[worker_id]
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
            await asyncio.sleep(WATCH_INTERVAL_S)
        migrated = len(worker.in_flight)
        if worker.live:
            self._pool.remove(worker_id, "drained", failed=False)
            worker.socket.send(encode_message(Shutdown()))
        return DrainResult(worker_id, started - migrated, migrated, remaining)

    def _outstanding(self, worker: Worker) -> int:
        total = 0
        for request_id in worker.in_flight:
            stream = self._streams[request_id]
            request = stream.request
            if stream.last_output_at is None:
                total += len(request.prompt_token_ids) + len(stream.produced)
            total += (1 if stream.prefilling else request.sampling.max_tokens) - len(
                stream.produced
            )
        return total

    def _root_key(self) -> bytes:
        model = self._pool.model
        return bytes.fromhex(model.fingerprint) if model is not None else b""

    def end_all(self, reason: str) -> int:
        """End every request in flight with `reason` (its client gets the error event) and
        abort it on its worker, which frees its blocks; returns how many there were."""
        ended = self._streams.open_streams()
        aborts: dict[int, list[str]] = {}
        for stream in ended:
            worker = stream.worker
            if worker is not None and worker.live:
                aborts.setdefault(worker.worker_id, []).append(stream.request.request_id)
            self._streams.fail(stream, EngineUnavailable(reason))
        for worker_id, request_ids in aborts.items():
            self._pool.workers[worker_id].socket.send(encode_message(AbortRequest(request_ids)))
        return len(ended)


def _charged(streams: list[Stream]) -> list[Stream]:
    """The requests a worker's crash is charged to: those it had not yet answered since
    they were sent there, when there are any (a request that kills its worker does so as
    the worker takes it in or computes its prompt, while the others it was already
    serving go on being answered); else all of them, when it died mid-decode."""
    unanswered = [stream for stream in streams if stream.last_output_at is None]
    return unanswered or streams
