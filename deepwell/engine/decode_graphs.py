"""Decode steps at fixed batch sizes (CUDA graphs): a batch of single-token decodes is padded
to the next capture size, its inputs copied into that size's static buffers and the step's
graph replayed. CUDA records a torch.cuda.CUDAGraph per graph key (`CudaGraphReplay`); any
other device runs the same buffers eagerly (`EagerReplay`), so the CPU tests this path.

A graph replays kernels on fixed addresses with fixed launch shapes, and the host-side
values the forward branches on are baked in. So a decode step hands the model fixed-size
metadata: for paged full attention (Llama, Qwen, the embedded SmolLM2) `FixedDecodeMetadata`
(block tables padded to max_blocks_per_seq, context lengths and cache slots as tensors), for
DeepSeek-V4.1's rings and compressed caches `FixedDecodePlans` (window rows, the entries a
padded block table holds with their visible counts, compressor tails and state slots as
tensors of the batch size and the layout's shapes). Its graph key is then only the padded
batch size and the model: every step of that size replays the same graph, whatever its
contexts. A step whose plans have no fixed-size form (batch-invariant query tiles, a row
before its replay start in compact bounded replay) keys its graphs by the signature of
everything it hands the model too (each tensor's shape and dtype, each plain value), and
replays only when that repeats. Either way a graph's buffers are reused only for a step of
the same signature: a mismatch is an error, not a replay of the wrong shapes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from deepwell.engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

# DeepInfer's grid: 1, 2, 4, then every 8 (DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL,
# spec/deepinfer.md, environment table).
SIZE_INTERVAL = 8
# Graphs (and their static buffers) kept at once, the least recently replayed dropped first.
MAX_GRAPHS = 32

# A decode step's model inputs: (input ids [rows], positions [rows], step metadata).
StepInputs = tuple[torch.Tensor, torch.Tensor, Any]
# Runs the model on a step's inputs; returns its hidden states [rows, hidden].
Forward = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def capture_sizes(max_batch: int, interval: int = SIZE_INTERVAL) -> list[int]:
    """The batch sizes decode graphs exist for: 1, 2, 4, then every `interval`, and
    `max_batch` itself, none above it."""
    if max_batch < 1 or interval < 1:
        raise ValueError(f"capture sizes need max_batch and interval >= 1, got {max_batch}")
    small = [size for size in (1, 2, 4) if size < interval]
    sizes = [size for size in small + list(range(interval, max_batch + 1, interval))]
    sizes = [size for size in sizes if size < max_batch]
    return sizes + [max_batch]


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest capture size holding `batch` rows; None when none does (eager)."""
    return next((size for size in sizes if size >= batch), None)


def padding_chunks(chunks: list[ScheduledChunk], size: int) -> list[ScheduledChunk]:
    """`size - len(chunks)` rows that repeat the last decode: the same token, position,
    slot and block table, so they write the bytes that row writes where it writes them, and
    they sample nothing. Padding needs no reserved block or state slot this way, for every
    model and cache kind; the padded rows' outputs are never read."""
    last = dataclasses.replace(chunks[-1], completes=False, draft=[])
    return [last] * (size - len(chunks))


def signature(value: Any) -> tuple:
    """What a captured graph bakes in of `value`: each tensor's shape, dtype and device, each
    plain value as is, through dataclasses, lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple(
            signature(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        )
    if isinstance(value, list | tuple):
        return (type(value).__name__,) + tuple(signature(item) for item in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((key, signature(item)) for key, item in value.items())
    return ("value", value)


def static_copy(value: Any) -> Any:
    """`value` with every tensor cloned: buffers the step's tensors are copied into."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: static_copy(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, list):
        return [static_copy(item) for item in value]
    if isinstance(value, tuple):
        return tuple(static_copy(item) for item in value)
    if isinstance(value, dict):
        return {key: static_copy(item) for key, item in value.items()}
    return value


def copy_into(static: Any, value: Any) -> None:
    """Copy every tensor of `value` into its place in `static` (same signature)."""
    if isinstance(static, torch.Tensor):
        static.copy_(value, non_blocking=True)
    elif dataclasses.is_dataclass(static) and not isinstance(static, type):
        for f in dataclasses.fields(static):
            if f.init:
                copy_into(getattr(static, f.name), getattr(value, f.name))
    elif isinstance(static, list | tuple):
        for static_item, item in zip(static, value, strict=True):
            copy_into(static_item, item)
    elif isinstance(static, dict):
        for key, static_item in static.items():
            copy_into(static_item, value[key])


@dataclasses.dataclass(frozen=True)
class GraphKey:
    """Which graph a decode step replays: its padded batch size and the model's kind, and,
    for a step without fixed-size metadata, the signature of its inputs."""

    batch_size: int
    model: str
    inputs: tuple = ()


class GraphShapeError(RuntimeError):
    """A step's inputs do not have the shapes of its key's graph (an engine bug: replaying
    would read and write the wrong rows)."""


def _check_same(key: GraphKey, captured: tuple, step: tuple) -> None:
    if captured != step:
        raise GraphShapeError(
            f"decode graph {key.model} x {key.batch_size}: the step's inputs differ from the "
            f"captured graph's ({step} against {captured})"
        )


class GraphReplay(Protocol):
    """Runs a padded decode step through the graph of its key, keeping that graph's buffers."""

    def run(self, key: GraphKey, inputs: StepInputs, forward: Forward) -> torch.Tensor: ...


class EagerReplay:
    """The graph path without a graph (CPU, or any device without CUDA graphs): the step's
    inputs go into its key's static buffers and the forward runs on those, eagerly."""

    def __init__(self, max_graphs: int = MAX_GRAPHS) -> None:
        self.buffers: OrderedDict[GraphKey, tuple[StepInputs, tuple]] = OrderedDict()
        self.max_graphs = max_graphs
        # Steps run on a key's buffers after its first: what a CUDA graph would replay.
        self.replays = 0

    def run(self, key: GraphKey, inputs: StepInputs, forward: Forward) -> torch.Tensor:
        held = self.buffers.get(key)
        step_signature = signature(inputs)
        if held is None:
            static = static_copy(inputs)
            self.buffers[key] = (static, step_signature)
            _evict(self.buffers, self.max_graphs)
        else:
            static, captured = held
            _check_same(key, captured, step_signature)
            self.buffers.move_to_end(key)
            copy_into(static, inputs)
            self.replays += 1
        return forward(*static)


@dataclasses.dataclass
class _CapturedGraph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: StepInputs
    hidden: torch.Tensor
    signature: tuple


class CudaGraphReplay:
    """torch.cuda.CUDAGraph per key: a key's first step runs eagerly, its second warms up on
    a side stream and captures, later ones copy into the static buffers and replay.

    Running a step's forward more than once is safe: a forward writes its rows' cache
    entries at the places the metadata names, from its inputs and the entries before them,
    so the warm-up and capture runs leave the cache as one run does."""

    def __init__(self, max_graphs: int = MAX_GRAPHS) -> None:
        self.graphs: OrderedDict[GraphKey, _CapturedGraph] = OrderedDict()
        # Keys seen once: captured when they come again (a key that never repeats is
        # never worth a capture).
        self.seen: OrderedDict[GraphKey, None] = OrderedDict()
        self.max_graphs = max_graphs
        self.pool = None
        self.captures = 0
        self.replays = 0

    def run(self, key: GraphKey, inputs: StepInputs, forward: Forward) -> torch.Tensor:
        captured = self.graphs.get(key)
        if captured is not None:
            _check_same(key, captured.signature, signature(inputs))
            self.graphs.move_to_end(key)
            copy_into(captured.inputs, inputs)
            captured.graph.replay()
            self.replays += 1
            return captured.hidden
        if key not in self.seen:
            self.seen[key] = None
            _evict(self.seen, 4 * self.max_graphs)
            return forward(*inputs)
        del self.seen[key]
        static = static_copy(inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = forward(*static)
        self.graphs[key] = _CapturedGraph(graph, static, hidden, signature(inputs))
        _evict(self.graphs, self.max_graphs)
        self.captures += 1
        graph.replay()
        self.replays += 1
        return hidden


def _evict(table: OrderedDict, limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)


class DecodeGraphs:
    """Which decode steps take the graph path, their padding, and their replay."""

    def __init__(self, sizes: list[int], replay: GraphReplay, max_blocks_per_seq: int) -> None:
        """`max_blocks_per_seq`: the width of a fixed-size step's block tables, enough for
        the longest sequence (max_model_len)."""
        self.sizes = sizes
        self.replay = replay
        self.max_blocks_per_seq = max_blocks_per_seq

    def size_for(self, chunks: list[ScheduledChunk]) -> int | None:
        """The padded batch size of a step of `chunks`; None when it is not a step of
        single-token decodes that a capture size holds (prefill, verify rows: eager)."""
        if not chunks or any(c.num_rows != 1 or c.draft for c in chunks):
            return None
        return padded_size(len(chunks), self.sizes)

    def run(
        self, batch_size: int, model: str, inputs: StepInputs, forward: Forward, fixed: bool
    ) -> torch.Tensor:
        """The padded step's hidden states [batch_size, hidden] through its graph; `fixed`:
        the step's metadata is fixed-size (FixedDecodeMetadata, FixedDecodePlans), so its
        key needs no signature."""
        key = GraphKey(batch_size, model, () if fixed else signature(inputs))
        return self.replay.run(key, inputs, forward)


def decode_graphs_for(
    device: torch.device,
    enforce_eager: bool,
    max_num_seqs: int,
    expert_parallel: bool,
    max_blocks_per_seq: int,
    model_blocker: str | None = None,
) -> DecodeGraphs | None:
    """The engine's decode graphs: CUDA graphs on a CUDA device unless `enforce_eager`, or
    expert parallelism, whose all-to-alls take their sizes on the host mid-step (no capture
    holds them), or a model whose step reads device values on the host as it is built
    (`model_blocker`, ModelHooks.graph_blocker); none elsewhere. Which, is said once in the
    log."""
    if device.type != "cuda":
        logger.info("decode graphs: off on %s (CUDA graphs need a CUDA device)", device.type)
        return None
    if enforce_eager:
        logger.info("decode graphs: off (--enforce-eager)")
        return None
    if expert_parallel:
        logger.info("decode graphs: off (expert-parallel all-to-alls are sized on the host)")
        return None
    if model_blocker is not None:
        logger.info("decode graphs: off (%s)", model_blocker)
        return None
    sizes = capture_sizes(max_num_seqs)
    logger.info("decode graphs: CUDA graphs at batch sizes %s", sizes)
    return DecodeGraphs(sizes, CudaGraphReplay(), max_blocks_per_seq)
