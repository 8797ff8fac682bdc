"""BlockPool: fixed-size KV blocks handed out by id, reference-counted.

A block returns to the free list when its last holder frees it; prefix caching (a later
issue) will share blocks by raising their counts and keep freed ones findable by key.
"""

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_ids):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(count)]
        for block_id in ids:
            self.ref_counts[block_id] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        # Reverse order puts a sequence's tail blocks back first, so the head blocks stay
        # untouched longest (they are the ones a prefix cache would reuse).
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self.free_ids.append(block_id)
