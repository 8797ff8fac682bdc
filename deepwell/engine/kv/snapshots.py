"""RingSnapshots: the ring rows a chunk starting at a block boundary reads, saved when a
step crosses that boundary, so a prefix hit there restores the rings exactly.

Stacked window layers (DeepSeek-V4.1) cannot be rebuilt by replaying a few tokens, so the
per-sequence state at a block boundary h is kept beside the blocks: each snapshotted ring
layer's rows for the positions just before h (a window's last `window - 1`; a compressor
tail's incomplete group, empty at a block boundary since the block size is a multiple of
every compress ratio). Engram's token history comes from the token ids. A snapshot is
keyed by the prefix key of the block ending at h, lives in a bounded LRU and leaves when
that block is handed out again.
"""

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import KVLayout
from deepwell.engine.kv.replay import BoundedReplay

# Snapshots kept in memory per state slot: a running sequence's latest boundaries and the
# last ones of finished conversations (their next turn's hit point), least recently used
# evicted first.
SNAPSHOTS_PER_SLOT = 4


@dataclass(frozen=True)
class SnapshotPart:
    """One ring layer's rows in a snapshot."""

    ring: str
    layer: int
    num_rows: int
    entry_shape: tuple[int, ...]
    dtype: torch.dtype


def snapshot_parts(
    layout: KVLayout, replay: BoundedReplay, block_size: int, dtype: torch.dtype
) -> list[SnapshotPart]:
    """What a snapshot holds: every ring layer when exact; in a truncation mode not the
    YOCO consumers' windows (a hit stops at the replay start and recomputes them)."""
    parts = []
    for ring in layout.rings:
        num_rows = ring.rows_before_boundary(block_size)
        if not num_rows:
            continue
        layers = range(ring.num_layers)
        if replay.bounded and ring.consumers_from is not None:
            layers = range(ring.consumers_from)
        parts += [
            SnapshotPart(ring.name, layer, num_rows, ring.entry_shape, ring.dtype or dtype)
            for layer in layers
        ]
    return parts


class RingSnapshots:
    def __init__(self, parts: list[SnapshotPart], capacity: int) -> None:
        self.parts = parts
        self.capacity = capacity
        self._by_key: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()

    @property
    def snapshot_bytes(self) -> int:
        return sum(p.num_rows * math.prod(p.entry_shape) * p.dtype.itemsize for p in self.parts)

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: bytes) -> list[torch.Tensor] | None:
        tensors = self._by_key.get(key)
        if tensors is not None:
            self._by_key.move_to_end(key)
        return tensors

    def put(self, key: bytes, tensors: list[torch.Tensor]) -> None:
        self._by_key[key] = tensors
        self._by_key.move_to_end(key)
        while len(self._by_key) > self.capacity:
            self._by_key.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._by_key.pop(key, None)

    def capture(self, cache: KVCache, slot: int, boundary: int) -> list[torch.Tensor]:
        """A copy of the slot's rows for the positions just before `boundary`; the rings
        must still hold them (`RingSpec.extra_rows`)."""
        tensors = []
        for part in self.parts:
            ring = cache.rings[part.ring][part.layer]
            rows = torch.arange(boundary - part.num_rows, boundary, device=ring.device)
            tensors.append(ring[slot, rows % ring.shape[1]])
        return tensors

    def restore(
        self, cache: KVCache, slot: int, boundary: int, tensors: list[torch.Tensor]
    ) -> None:
        for part, tensor in zip(self.parts, tensors, strict=True):
            ring = cache.rings[part.ring][part.layer]
            rows = torch.arange(boundary - part.num_rows, boundary, device=ring.device)
            ring[slot, rows % ring.shape[1]] = tensor
