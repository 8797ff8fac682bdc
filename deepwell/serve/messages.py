"""Typed messages between the HTTP process and engine workers, and their msgpack framing.

Each message is a frozen dataclass; on the wire it is a msgpack ext value whose code names
the class and whose payload is the list of its fields in declaration order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

from deepwell.engine.outputs import RequestOutput, TokenLogprobs
from deepwell.settings.engine import EngineArgs
from deepwell.settings.parallel import ParallelConfig


@dataclass(frozen=True)
class WorkerConfig:
    """Launcher → worker (on its command line): which sockets, and the engine's settings,
    built and checked by the launcher (environment variables included)."""

    worker_id: int
    parent_pid: int
    inbox_address: str
    outbox_address: str
    # Model, budget, KV cache, kernels and this worker's rank of a parallel group.
    engine: EngineArgs


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What a request's output must match: the engine's `StructuredOutput`, on the wire.

    `kind` is json_schema, json_object, regex or ebnf; the grammar applies only after
    `trigger_token_ids` when that is not empty (thinking models: after `</think>`).
    """

    kind: str
    spec: str
    trigger_token_ids: list[int]


@dataclass(frozen=True)
class GenerateRequest:
    """Frontend → worker: generate up to `max_tokens` tokens after `prompt_token_ids`."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_token_ids: list[int]
    top_logprobs: int | None
    structured_output: StructuredOutputSpec | None = None
    # Traffic class, "chat" or "agent": the KV store TTL of the request's blocks.
    cache_class: str = "chat"
    # The engine's SamplingParams of the same names (engine/sampling_params.py).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias) pairs: msgpack maps want string keys.
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class AbortRequest:
    """Frontend → worker: drop these requests now and free their KV blocks."""

    request_ids: list[str]


@dataclass(frozen=True)
class Shutdown:
    """Frontend → worker: abort everything and exit; `refusal` says why a joining worker
    was turned away ("" for a normal stop)."""

    refusal: str = ""


@dataclass(frozen=True)
class RequestRejected:
    """The engine refused a request (its own validation); nothing of it remains queued."""

    request_id: str
    message: str


@dataclass(frozen=True)
class WorkerStats:
    """Scheduler and KV-cache occupancy of one worker after a step."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    # Counters since the worker started: prompt tokens looked up in the prefix cache and
    # those it supplied; KV store block hits, misses, bytes and bad files.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    store_hits: int = 0
    store_misses: int = 0
    store_read_bytes: int = 0
    store_written_bytes: int = 0
    store_errors: int = 0
    # Speculative decoding counters since start: request-steps that decoded, draft positions
    # verified and accepted; acceptance per draft position and the confidence error.
    spec_decode_steps: int = 0
    spec_verified_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_position_accept_rates: list[float] = field(default_factory=list)
    spec_confidence_error: float = 0.0


# Rates and errors are averages, not counters: across workers they are weighted by how many
# speculative steps each worker verified.
_AVERAGED_STATS = ("spec_position_accept_rates", "spec_confidence_error")


def combine_stats(stats: list[WorkerStats]) -> WorkerStats:
    """The pool's view of several workers: counters summed, speculative rates averaged."""
    counters = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in fields(WorkerStats)
        if f.name not in _AVERAGED_STATS
    }
    steps = counters["spec_decode_steps"]
    if not steps:
        return WorkerStats(**counters)
    positions = max(len(s.spec_position_accept_rates) for s in stats)
    rates = [
        sum(
            s.spec_decode_steps * s.spec_position_accept_rates[i]
            for s in stats
            if i < len(s.spec_position_accept_rates)
        )
        / steps
        for i in range(positions)
    ]
    error = sum(s.spec_decode_steps * s.spec_confidence_error for s in stats) / steps
    return WorkerStats(**counters, spec_position_accept_rates=rates, spec_confidence_error=error)


@dataclass(frozen=True)
class StepOutputs:
    """Worker → frontend: everything one engine step produced, plus the worker's load.

    The outputs are the engine's own `RequestOutput`s: the stop decision and the token
    counts travel as the engine made them.
    """

    worker_id: int
    outputs: list[RequestOutput]
    rejected: list[RequestRejected]
    stats: WorkerStats


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP process needs to know about a worker's model to encode and decode for it.

    The worker is the one that loads the model, so it is the source of these facts; the
    HTTP process never reads weights.
    """

    name: str
    architecture: str
    context_limit: int
    tokenizer_json: str
    chat_template: str | None
    eos_token_ids: list[int]
    # The dtype the worker computes in, what was asked for, and why (cpu_dtype.DtypeChoice).
    dtype: str = ""
    requested_dtype: str = ""
    dtype_reason: str = ""
    bos_token_id: int | None = None
    # Hex of the root of the KV block-key chain (model, weights, KV layout, block size,
    # dtype; kv/prefix.py): workers of one cluster must agree on it. "" without prefix
    # caching.
    fingerprint: str = ""


@dataclass(frozen=True)
class WorkerReady:
    """Worker → frontend: the model is loaded and requests may be sent."""

    worker_id: int
    model: ModelInfo
    stats: WorkerStats
    # Where a worker that joined on its own (`deepwell worker --connect`) takes requests;
    # "" for the workers the front end started, whose addresses it chose.
    inbox_address: str = ""


@dataclass(frozen=True)
class WorkerFailed:
    """Worker → frontend: the worker cannot serve (load error, engine crash) and exits."""

    worker_id: int
    message: str


@dataclass(frozen=True)
class Heartbeat:
    """Worker → frontend, every `HEARTBEAT_INTERVAL_S` from a thread of its own: still alive,
    even while a long engine step runs."""

    worker_id: int


HEARTBEAT_INTERVAL_S = 0.1


MESSAGE_TYPES: tuple[type, ...] = (
    WorkerConfig,
    GenerateRequest,
    AbortRequest,
    Shutdown,
    RequestOutput,
    TokenLogprobs,
    RequestRejected,
    WorkerStats,
    StepOutputs,
    ModelInfo,
    WorkerReady,
    WorkerFailed,
    StructuredOutputSpec,
    Heartbeat,
    EngineArgs,
    ParallelConfig,
)
_CODE_OF = {cls: code for code, cls in enumerate(MESSAGE_TYPES)}


def _to_ext(obj: Any) -> msgpack.ExtType:
    code = _CODE_OF.get(type(obj))
    if code is None:
        raise TypeError(f"cannot send {type(obj).__name__} between processes")
    payload = [getattr(obj, field.name) for field in fields(obj)]
    return msgpack.ExtType(code, msgpack.packb(payload, default=_to_ext))


def _from_ext(code: int, data: bytes) -> Any:
    if code >= len(MESSAGE_TYPES):
        raise ValueError(f"unknown message code {code}")
    return MESSAGE_TYPES[code](*msgpack.unpackb(data, ext_hook=_from_ext, use_list=True))


def encode_message(message: Any) -> bytes:
    """Serialize one message (any of `MESSAGE_TYPES`) to a msgpack frame."""
    return msgpack.packb(message, default=_to_ext)


def decode_message(frame: bytes) -> Any:
    """Parse a frame written by `encode_message` back into its dataclass."""
    return msgpack.unpackb(frame, ext_hook=_from_ext, use_list=True)
