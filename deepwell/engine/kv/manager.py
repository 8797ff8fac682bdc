"""KVCacheManager: gives each request the blocks and state slot its tokens need, reusing
cached prefix blocks (from memory, or loaded from the KV store) where their keys match.

Model-agnostic: it reads only the model's KVLayout (how many specs share a block table,
whether a per-sequence slot is needed, how far a hit may reach), never the model itself.
Layouts with ring snapshots hit only at a block boundary that has one (kv/snapshots.py),
no further than the bounded-replay rule allows (kv/replay.py).
"""

from dataclasses import dataclass, field

import torch

from deepwell.engine.kv.block_pool import BlockPool
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import KVLayout
from deepwell.engine.kv.prefix_hash import chain_keys
from deepwell.engine.kv.replay import EXACT, BoundedReplay
from deepwell.engine.kv.slot_pool import SlotPool
from deepwell.engine.kv.snapshots import RingSnapshots
from deepwell.engine.kv.store_io import StoreIO
from deepwell.engine.request import Request


@dataclass
class PrefixHit:
    """The leading blocks a request can reuse: cached in memory, then loaded from the store."""

    block_ids: list[int] = field(default_factory=list)
    stored: list[tuple[bytes, list[torch.Tensor]]] = field(default_factory=list)
    block_size: int = 0
    # The ring snapshot at the hit's end, for layouts with ring snapshots.
    snapshot: list[torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return (len(self.block_ids) + len(self.stored)) * self.block_size


@dataclass
class PrefixCounters:
    """Prompt tokens looked up in the prefix cache at admission, and how many it supplied."""

    queried_tokens: int = 0
    hit_tokens: int = 0


class KVCacheManager:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        root_key: bytes | None = None,
        cache: KVCache | None = None,
        store: StoreIO | None = None,
        replay: BoundedReplay = EXACT,
        snapshots: RingSnapshots | None = None,
    ):
        """`root_key` starts every request's key chain (the model fingerprint); None turns
        prefix caching off. With a `store`, `cache` holds the blocks it reads and writes.
        A layout with ring snapshots needs `snapshots` (and `cache`) to hit at all."""
        layout.check(block_size)
        if store is not None and (cache is None or root_key is None):
            raise ValueError("a KV store needs the cache tensors and prefix caching")
        if snapshots is not None and cache is None:
            raise ValueError("ring snapshots need the cache tensors")
        self.layout = layout
        self.block_size = block_size
        self.root_key = root_key
        self.cache = cache
        self.store = store
        self.replay = replay
        self.snapshots = snapshots
        # Prompt chunks end at the replay start's block boundary (`snapshot_cut`).
        self.cuts_chunks = snapshots is not None and replay.bounded
        self.block_pool = BlockPool(num_blocks, self._evicted)
        self.slot_pool = SlotPool(num_slots) if layout.needs_slots else None
        self.counters = PrefixCounters()
        # Since the last `take_key_changes`: each key made findable (True) or evicted
        # (False), its last change only. None until `watch_keys`, so that an engine nobody
        # asks keeps nothing.
        self._key_changes: dict[bytes, bool] | None = None

    def watch_keys(self) -> None:
        """Keep the keys of blocks cached and evicted for `take_key_changes` (a serve worker
        reports them, so the router's prefix index follows what this engine holds)."""
        if self._key_changes is None:
            self._key_changes = {}

    def take_key_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(keys cached, keys evicted) since the last call, each key in the list of its
        last change, so the two can be applied in either order; empty unless watched."""
        changes = self._key_changes
        if not changes:
            return [], []
        self._key_changes = {}
        cached = [key for key, held in changes.items() if held]
        return cached, [key for key, held in changes.items() if not held]

    def _register(self, block_id: int, key: bytes) -> bool:
        registered = self.block_pool.register(block_id, key)
        if registered and self._key_changes is not None:
            self._key_changes[key] = True
        return registered

    def _evicted(self, key: bytes) -> None:
        # Ring snapshots leave with their block.
        if self.snapshots is not None:
            self.snapshots.discard(key)
        if self._key_changes is not None:
            self._key_changes[key] = False

    def keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first `num_blocks` blocks (they must be full of tokens)."""
        keys = request.block_keys
        if len(keys) < num_blocks:
            parent = keys[-1] if keys else self.root_key
            keys += chain_keys(
                parent,
                request.token_ids,
                self.block_size,
                len(keys),
                num_blocks,
                request.image_spans,
            )
        return keys[:num_blocks]

    def prefetch(self, request: Request) -> None:
        """Start reading the new request's prompt blocks that memory lacks from the store."""
        if self.store is None:
            return
        keys = self.keys(request, (request.num_tokens - 1) // self.block_size)
        cached = 0
        while cached < len(keys) and self.block_pool.lookup(keys[cached]) is not None:
            cached += 1
        snapshot_keys = []
        if self.snapshots is not None:
            # Stored snapshots past the best one memory has, best first, each with the
            # number of stored blocks it needs.
            limit = min(len(keys), self.replay.hit_limit(request.num_tokens) // self.block_size)
            in_memory = self._snapshot_in_memory(keys, min(cached, limit))
            snapshot_keys = [(n - cached, keys[n - 1]) for n in range(limit, in_memory, -1)]
        if cached < len(keys) or snapshot_keys:
            request.store_load = self.store.load(keys[cached:], request.cache_class, snapshot_keys)

    def _snapshot_in_memory(self, keys: list[bytes], limit: int) -> int:
        """The most leading blocks (at most `limit`) whose end has a snapshot in memory."""
        for count in range(limit, 0, -1):
            if self.snapshots.get(keys[count - 1]) is not None:
                return count
        return 0

    def find_prefix(self, request: Request) -> PrefixHit | None:
        """The longest reusable run of cached blocks, leaving at least one token to compute;
        None while the request's stored blocks are still loading."""
        hit = PrefixHit(block_size=self.block_size)
        if self.root_key is None:
            return hit
        if request.store_load is not None:
            if not request.store_load.done():
                return None
            blocks, snapshots = request.store_load.result()
            request.stored_blocks = dict(blocks)
            request.stored_snapshots = snapshots
            request.store_load = None
        if request.params.wants_prompt_logprobs:
            # Every prompt position needs its logits, so none is taken from the cache.
            return hit
        keys = self.keys(request, (request.num_tokens - 1) // self.block_size)
        for key in keys:
            block_id = self.block_pool.lookup(key)
            if block_id is None:
                break
            hit.block_ids.append(block_id)
        for key in keys[len(hit.block_ids) :]:
            tensors = request.stored_blocks.get(key)
            if tensors is None:
                break
            hit.stored.append((key, tensors))
        if self.snapshots is None:
            usable = self.layout.reusable_prefix(hit.num_tokens, self.block_size)
            usable //= self.block_size
        else:
            usable = self._snapshot_hit(request, keys, hit)
        del hit.block_ids[usable:]
        del hit.stored[max(0, usable - len(hit.block_ids)) :]
        return hit

    def _snapshot_hit(self, request: Request, keys: list[bytes], hit: PrefixHit) -> int:
        """Blocks of the hit up to the last boundary, within the replay rule's limit, that
        has a ring snapshot (memory first, then the store); sets `hit.snapshot`."""
        found = len(hit.block_ids) + len(hit.stored)
        limit = min(found, self.replay.hit_limit(request.num_tokens) // self.block_size)
        for count in range(limit, 0, -1):
            key = keys[count - 1]
            snapshot = self.snapshots.get(key)
            if snapshot is None:
                snapshot = request.stored_snapshots.get(key)
            if snapshot is not None:
                hit.snapshot = snapshot
                return count
        return 0

    def snapshot_cut(self, request: Request, start: int, num_tokens: int) -> int:
        """The tokens of a chunk from `start`, ended at the block boundary at or before the
        request's replay start if the chunk would cross it (bounded modes only).

        A chunk snapshots only the last boundary it crosses (the rings keep one block past
        the window), and a later request extending this one may hit at most its own replay
        start, which is at or after this boundary: so the boundary always gets a snapshot.
        """
        cut = self.replay.replay_start(request.num_tokens) // self.block_size * self.block_size
        if start < cut < start + num_tokens:
            return cut - start
        return num_tokens

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks for `request` to hold its first `num_tokens` tokens."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        if self.slot_pool is not None and request.slot is None and not self.slot_pool.num_free:
            return False
        needed = self.blocks_needed(request, num_tokens)
        if hit is not None:
            # Hit blocks need no new block, but free ones leave the free list when revived.
            revived = sum(1 for b in hit.block_ids if self.block_pool.ref_counts[b] == 0)
            needed += revived - len(hit.block_ids)
        return needed <= self.block_pool.num_free

    def admit(self, request: Request, hit: PrefixHit, num_tokens: int) -> None:
        """Give a waiting request its hit blocks and blocks up to `num_tokens`; its counter
        starts after the hit."""
        pool = self.block_pool
        pool.share(hit.block_ids)
        request.block_ids = list(hit.block_ids)
        if hit.stored:
            loaded = pool.allocate(len(hit.stored))
            for block_id, (key, _) in zip(loaded, hit.stored, strict=True):
                self._register(block_id, key)
            self.cache.write_blocks(loaded, [tensors for _, tensors in hit.stored])
            request.block_ids += loaded
        request.stored_blocks = {}
        request.stored_snapshots = {}
        request.num_computed_tokens = request.num_cached_tokens = hit.num_tokens
        request.num_committed_blocks = hit.num_tokens // self.block_size
        request.replay_start = self.replay.replay_start(request.num_tokens)
        counters = self.counters
        counters.queried_tokens += request.num_tokens
        counters.hit_tokens += hit.num_tokens
        self.allocate(request, num_tokens)
        if hit.snapshot is not None:
            self.snapshots.restore(self.cache, request.slot, hit.num_tokens, hit.snapshot)

    def allocate(self, request: Request, num_tokens: int) -> None:
        # The cache is not cleared when allocated (kv/cache.py): what a request is handed is.
        if self.slot_pool is not None and request.slot is None:
            request.slot = self.slot_pool.allocate()
            if self.cache is not None:
                self.cache.clear_slot(request.slot)
        fresh = self.block_pool.allocate(self.blocks_needed(request, num_tokens))
        if fresh and self.cache is not None:
            self.cache.clear_blocks(fresh)
        request.block_ids += fresh

    def commit(
        self,
        request: Request,
        num_computed: int,
        snapshot: tuple[int, list[torch.Tensor]] | None = None,
    ) -> None:
        """Make the request's full blocks among its first `num_computed` tokens findable,
        and store the new ones. `num_computed` counts tokens whose KV is written: a step
        still computing has moved the request's counter past it. `snapshot` is the step's
        (block boundary, ring snapshot) for this request, if it took one."""
        if self.root_key is None:
            return
        full = num_computed // self.block_size
        start = request.num_committed_blocks
        if full <= start:
            return
        keys = self.keys(request, full)
        request.num_committed_blocks = full
        new = []
        for index in range(start, full):
            block_id = request.block_ids[index]
            if self._register(block_id, keys[index]):
                new.append((block_id, keys[index]))
        if self.store is not None and new:
            # Copied now: the blocks may be reused once the request frees them.
            parts = self.cache.read_blocks([block_id for block_id, _ in new])
            blocks = [(key, [part[i] for part in parts]) for i, (_, key) in enumerate(new)]
            self.store.save(blocks, request.cache_class)
        if snapshot is not None:
            boundary, tensors = snapshot
            key = keys[boundary // self.block_size - 1]
            if self.snapshots.get(key) is None:
                self.snapshots.put(key, tensors)
                if self.store is not None:
                    self.store.save_snapshot(key, tensors, request.cache_class)

    def free(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        if request.slot is not None and self.slot_pool is not None:
            self.slot_pool.free(request.slot)
            request.slot = None

    @property
    def usage(self) -> float:
        pool = self.block_pool
        return 1 - pool.num_free / pool.num_blocks
