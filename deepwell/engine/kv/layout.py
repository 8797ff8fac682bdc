"""KV layouts: what per-token and per-sequence state a model asks the cache to hold.

A model declares its layout; the cache manager allocates from it without knowing the model
(spec/deepinfer.md §1.6 "KV cache", spec/deepseek_v41.md §4).
"""

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum

import torch


class CacheRole(Enum):
    """What a spec's entries are, which decides the step metadata its readers get
    (layers/step_metadata.py)."""

    # Paged: one key or value entry per token, read by full attention (AttentionBackend).
    FULL_ATTENTION = "full_attention"
    # Paged: one entry per `compress_ratio` tokens (compressed KV, index keys).
    COMPRESSED = "compressed"
    # Ring: the last `window` positions' keys.
    WINDOW = "window"
    # Ring: projections of the positions of a compression group not yet complete; its
    # `window` is the group size minus one.
    COMPRESSOR_TAIL = "compressor_tail"


@dataclass(frozen=True)
class PagedSpec:
    """State that grows with the sequence, stored in the shared 128-token blocks.

    Full attention keeps one entry per token (ratio 1); a compressed cache keeps one entry per
    `compress_ratio` tokens. All paged specs share one block table per request: a block id
    covers the same token span in every spec, so prefix keys are model-agnostic.
    """

    name: str
    num_layers: int
    # Shape of one entry in one layer, e.g. (kv_heads, head_dim) for attention keys.
    entry_shape: tuple[int, ...]
    compress_ratio: int = 1
    role: CacheRole = CacheRole.FULL_ATTENTION
    # None: the cache's dtype (the engine's compute dtype).
    dtype: torch.dtype | None = None
    # Where a block's entry axis sits among the entry dims: 0 is token-major; 1 after a
    # head axis makes each head's rows of a block contiguous, which CPU attention wants.
    entry_axis: int = 0

    def entries_per_block(self, block_size: int) -> int:
        return block_size // self.compress_ratio

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        """Shape of one block of one layer."""
        dims = list(self.entry_shape)
        dims.insert(self.entry_axis, self.entries_per_block(block_size))
        return tuple(dims)


@dataclass(frozen=True)
class RingSpec:
    """A per-sequence sliding-window ring of `window + max_backtrack + extra_rows` rows per
    layer, row `p mod rows` holding position p.

    The backtracking slack keeps a full window after a speculative rollback (DeepInfer's
    DEEPINFER_MAX_BACKTRACKING_TOKENS). `extra_rows` keep the window before the last block
    boundary a step crossed until the step is done, so it can be snapshotted
    (kv/snapshots.py; DeepInfer's DEEPINFER_PREFILL_STORE_EXTRA_SIZE).
    """

    name: str
    num_layers: int
    entry_shape: tuple[int, ...]
    window: int
    max_backtrack: int
    dtype: torch.dtype | None = None
    role: CacheRole = CacheRole.WINDOW
    extra_rows: int = 0
    # The first of its layers written by a YOCO consumer (kv/replay.py), whose rows a
    # truncation mode rebuilds by replay rather than snapshots; None: no such layer.
    consumers_from: int | None = None

    @property
    def rows(self) -> int:
        return self.window + self.max_backtrack + self.extra_rows

    def rows_before_boundary(self, block_size: int) -> int:
        """Rows before a block boundary that a chunk starting there may read: a window's last
        `window - 1` (near the start some are before position 0: never read, harmless to
        copy); a compressor tail's incomplete group."""
        if self.role is CacheRole.WINDOW:
            return self.window - 1
        return block_size % (self.window + 1)


@dataclass(frozen=True)
class StateSpec:
    """A fixed-size per-sequence state slot (e.g. a compressor's pending tail)."""

    name: str
    num_layers: int
    state_shape: tuple[int, ...]
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class KVLayout:
    paged: tuple[PagedSpec, ...]
    rings: tuple[RingSpec, ...] = ()
    states: tuple[StateSpec, ...] = ()
    # False: replaying the last ring rows' tokens rebuilds the rings exactly, as when one
    # ring layer reads exact paged state (tests' sliding-window Llama). True: stacked ring
    # layers (V4.1) make such a replay inexact, so a prefix hit restores the rings from a
    # snapshot taken at its block boundary (kv/snapshots.py).
    ring_snapshots: bool = False
    # V4.1's YOCO boundary (DeepInfer's n_prefill_layer): ring layers from this one on are
    # consumers whose window may be bounded to a replayed suffix (kv/replay.py); None when
    # the model has no such layers.
    yoco_boundary: int | None = None
    # How many earlier token ids each step row carries besides its own (V4.1's Engram
    # hashes n-grams of the last tokens; spec/deepseek_v41.md §3.5).
    token_history: int = 0

    def check(self, block_size: int) -> None:
        for spec in self.paged:
            if block_size % spec.compress_ratio:
                raise ValueError(
                    f"block_size {block_size} is not a multiple of {spec.name}'s "
                    f"compress ratio {spec.compress_ratio}"
                )

    def reusable_prefix(self, hit_tokens: int, block_size: int) -> int:
        """Tokens a request may skip when the block cache holds its first `hit_tokens`, for
        layouts whose rings are rebuilt by replay (`ring_snapshots` False).

        Paged state is complete at every block boundary. A ring's window is not in the
        blocks, so it is rebuilt by replaying the last `rows` tokens before the hit point
        (SWA bounded replay, spec/deepinfer.md §1.6); the hit shrinks to the block
        boundary at or before the replay start, and only full blocks are ever shared.
        """
        replay = max((ring.rows for ring in self.rings), default=0)
        if not replay:
            return hit_tokens
        return max(0, hit_tokens - replay) // block_size * block_size

    def with_snapshot_rows(self, block_size: int) -> "KVLayout":
        """The layout with room in its window rings to snapshot a block boundary after the
        step that crossed it (`RingSpec.extra_rows`)."""
        rings = tuple(
            dataclasses.replace(ring, extra_rows=block_size)
            if ring.role is CacheRole.WINDOW
            else ring
            for ring in self.rings
        )
        return dataclasses.replace(self, rings=rings)

    def with_max_backtrack(self, rows: int) -> "KVLayout":
        """Every ring keeping at least `rows` rows beyond its window for rollbacks (DeepInfer's
        MAX_BACKTRACKING_TOKENS); a ring's own need stays the floor."""
        rings = tuple(
            dataclasses.replace(ring, max_backtrack=max(ring.max_backtrack, rows))
            for ring in self.rings
        )
        return dataclasses.replace(self, rings=rings)

    def max_draft_tokens(self, requested: int) -> int:
        """Draft tokens a step may verify: a verify chunk writes 1 + k ring rows, and
        rejected rows stay harmless while they only overwrite rows older than every read
        after a rollback, which holds for k < max_backtrack (DeepInfer sizes its rings
        with MAX_BACKTRACKING_TOKENS = NEXTN + 1, spec/deepinfer.md §1.4)."""
        slack = min((ring.max_backtrack for ring in self.rings), default=requested + 1)
        return min(requested, slack - 1)

    @property
    def needs_slots(self) -> bool:
        return bool(self.rings or self.states)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return sum(
            spec.num_layers
            * spec.entries_per_block(block_size)
            * math.prod(spec.entry_shape)
            * (spec.dtype or dtype).itemsize
            for spec in self.paged
        )

    def slot_bytes(self, dtype: torch.dtype) -> int:
        rings = sum(
            r.num_layers * r.rows * math.prod(r.entry_shape) * (r.dtype or dtype).itemsize
            for r in self.rings
        )
        states = sum(
            s.num_layers * math.prod(s.state_shape) * (s.dtype or dtype).itemsize
            for s in self.states
        )
        return rings + states
