"""BlockPool: fixed-size KV blocks handed out by id, reference-counted, findable by prefix key.

A block whose last holder frees it stays findable by its key until it is handed out again:
free blocks are reused in LRU order, blocks without content first (spec/deepinfer.md §1.6).
"""

from collections import OrderedDict
from collections.abc import Callable


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None) -> None:
        """`on_evict` hears each key whose block is handed out again (ring snapshots leave
        with their block)."""
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.ref_counts = [0] * num_blocks
        # Free blocks, next to hand out first. Holds cached blocks too: a hit takes one out.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._forget(block_id)
            self.ref_counts[block_id] = 1
            ids.append(block_id)
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), reviving free ones."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def register(self, block_id: int, key: bytes) -> bool:
        """Make a full block findable by `key`; False when another block already holds it."""
        if key in self._block_of or self._key_of[block_id] is not None:
            return False
        self._key_of[block_id] = key
        self._block_of[key] = block_id
        return True

    def free(self, block_ids: list[int]) -> None:
        # Reverse order puts a sequence's tail blocks back first, so its head blocks (the
        # ones other requests share most) are evicted last.
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None
                if self._key_of[block_id] is None:
                    # Nothing to find in it: hand it out before any cached block.
                    self._free.move_to_end(block_id, last=False)

    def _forget(self, block_id: int) -> None:
        key = self._key_of[block_id]
        if key is not None:
            self._key_of[block_id] = None
            del self._block_of[key]
            if self.on_evict is not None:
                self.on_evict(key)
