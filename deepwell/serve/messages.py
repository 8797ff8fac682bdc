"""Typed messages between the HTTP process and engine workers, and their msgpack framing.

Each message is a frozen dataclass; on the wire it is a msgpack ext value whose code names
the class and whose payload is the list of its fields in declaration order. The engine's
own torch-free types (SamplingParams, EngineStats) travel inside them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import msgpack
import numpy as np

from deepwell.engine.multimodal import ImageEmbedding, ImageInput
from deepwell.engine.outputs import RequestOutput, TokenLogprobs
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stats import EngineStats, SpecStats
from deepwell.engine.structured.spec import StructuredOutput
from deepwell.serve.images.grid import VisionSpec
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
    # serve --log-level and --log-format, for the worker's own log lines.
    log_level: str = "info"
    log_format: str = "text"
    # "encoder": the worker runs only the model's vision tower (serve --encoder-workers);
    # any other role runs the whole engine (prefill and decode differ only in routing).
    role: str = "mixed"


@dataclass(frozen=True)
class GenerateRequest:
    """Frontend → worker: generate after `prompt_token_ids` as `sampling` says."""

    request_id: str
    prompt_token_ids: list[int]
    # Checked on construction in the HTTP process; the worker hands it to the engine as is.
    sampling: SamplingParams
    # Traffic class, "chat" or "agent": the KV store TTL of the request's blocks.
    cache_class: str = "chat"
    # The prompt's images, in prompt order, each filling its span of prompt_token_ids.
    images: tuple[ImageInput, ...] = ()
    # Their span embeddings, when an encoder worker computed them: the engine reads these
    # instead of running its own vision tower.
    image_embeddings: tuple[ImageEmbedding, ...] = ()

    def __post_init__(self) -> None:
        # msgpack gives lists back.
        object.__setattr__(self, "images", tuple(self.images))
        object.__setattr__(self, "image_embeddings", tuple(self.image_embeddings))

    def continuation(self, produced: list[int], max_tokens: int) -> GenerateRequest:
        """This request resumed after the tokens it `produced`, for at most `max_tokens`
        more (moved to another worker, or its prompt alone on a prefill worker); the
        minimum length, the first tokens without EOS and the teacher-forced tokens count
        the tokens already out, a grammar consumes them before it constrains the next, and
        the prompt's logprobs went out with the first token."""
        done = len(produced)
        sampling = self.sampling
        if done:
            sampling = replace(
                sampling,
                first_n_token_no_eos=max(sampling.first_n_token_no_eos - done, 0),
                golden_token_ids=(sampling.golden_token_ids or [])[done:] or None,
                prompt_logprobs=False,
            )
            if sampling.structured_output is not None:
                sampling = replace(sampling, grammar_replay_token_ids=tuple(produced))
        min_tokens = min(max(sampling.min_tokens - done, 0), max_tokens)
        sampling = replace(sampling, max_tokens=max_tokens, min_tokens=min_tokens)
        return replace(self, prompt_token_ids=self.prompt_token_ids + produced, sampling=sampling)


@dataclass(frozen=True)
class EncodeImages:
    """Frontend → encoder worker: compute the span embeddings of a request's images."""

    request_id: str
    images: list[ImageInput]


@dataclass(frozen=True)
class ImagesEncoded:
    """Encoder worker → frontend: a request's image embeddings, in the order asked, or why
    they could not be computed (`error`, then no embeddings)."""

    worker_id: int
    request_id: str
    embeddings: list[ImageEmbedding]
    error: str = ""


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
    """The engine refused a request (its own validation), or failed on it (`internal`: an
    exception the worker caught, answered 500); nothing of it remains queued."""

    request_id: str
    message: str
    internal: bool = False


@dataclass(frozen=True)
class StepOutputs:
    """Worker → frontend: everything one engine step produced, plus the worker's load.

    The outputs are the engine's own `RequestOutput`s: the stop decision and the token
    counts travel as the engine made them.
    """

    worker_id: int
    outputs: list[RequestOutput]
    rejected: list[RequestRejected]
    stats: EngineStats
    # Prefix keys of the blocks the step made findable and of those it evicted (handed out
    # again), disjoint: the router's prefix index follows them (cluster/prefix_index.py).
    cached_keys: list[bytes] = field(default_factory=list)
    evicted_keys: list[bytes] = field(default_factory=list)


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
    # How the model's vision tower wants its images; None: it takes none.
    vision: VisionSpec | None = None


@dataclass(frozen=True)
class WorkerReady:
    """Worker → frontend: the model is loaded and requests may be sent."""

    worker_id: int
    model: ModelInfo
    stats: EngineStats
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
    even while a long engine step runs (a kernel build among them)."""

    worker_id: int
    # The native kernels this process has asked for, by name: "building", "loaded" or
    # "unavailable" (engine/layers/decode_kernel.py), for /metrics.
    kernels: dict[str, str] = field(default_factory=dict)


HEARTBEAT_INTERVAL_S = 0.1


MESSAGE_TYPES: tuple[type, ...] = (
    WorkerConfig,
    GenerateRequest,
    AbortRequest,
    Shutdown,
    RequestOutput,
    TokenLogprobs,
    RequestRejected,
    StepOutputs,
    ModelInfo,
    WorkerReady,
    WorkerFailed,
    Heartbeat,
    EngineArgs,
    ParallelConfig,
    SamplingParams,
    StructuredOutput,
    EngineStats,
    SpecStats,
    VisionSpec,
    ImageInput,
    ImageEmbedding,
    EncodeImages,
    ImagesEncoded,
)
_CODE_OF = {cls: code for code, cls in enumerate(MESSAGE_TYPES)}
# An image's pixels: [shape, dtype, bytes], after the message codes.
_ARRAY_CODE = len(MESSAGE_TYPES)


def _to_ext(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray):
        payload = [list(obj.shape), obj.dtype.str, np.ascontiguousarray(obj).tobytes()]
        return msgpack.ExtType(_ARRAY_CODE, msgpack.packb(payload))
    code = _CODE_OF.get(type(obj))
    if code is None:
        raise TypeError(f"cannot send {type(obj).__name__} between processes")
    payload = [getattr(obj, field.name) for field in fields(obj)]
    return msgpack.ExtType(code, msgpack.packb(payload, default=_to_ext))


def _from_ext(code: int, data: bytes) -> Any:
    if code == _ARRAY_CODE:
        shape, dtype, raw = msgpack.unpackb(data)
        # Writable (a bytearray), as the engine's tensors over it expect.
        return np.frombuffer(bytearray(raw), dtype=np.dtype(dtype)).reshape(shape)
    if code >= len(MESSAGE_TYPES):
        raise ValueError(f"unknown message code {code}")
    cls = MESSAGE_TYPES[code]
    values = _unpack(data)
    expected = len(fields(cls))
    if not isinstance(values, list) or len(values) != expected:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise ValueError(f"malformed {cls.__name__}: expected {expected} fields, got {got}")
    return cls(*values)


def _unpack(data: bytes) -> Any:
    # Map keys may be integers: SamplingParams.logit_bias is keyed by token id.
    return msgpack.unpackb(data, ext_hook=_from_ext, use_list=True, strict_map_key=False)


def encode_message(message: Any) -> bytes:
    """Serialize one message (any of `MESSAGE_TYPES`) to a msgpack frame."""
    return msgpack.packb(message, default=_to_ext)


def decode_message(frame: bytes) -> Any:
    """Parse a frame written by `encode_message` back into its dataclass.

    Raises ValueError for a frame that is not one: an unknown code, a wrong field count, or
    a field its class refuses (SamplingParams checks its values on construction).
    """
    return _unpack(frame)
