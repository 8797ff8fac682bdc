"""KVCacheManager: gives each request the blocks and state slot its tokens need.

Model-agnostic: it reads only the model's KVLayout (how many specs share a block table,
whether a per-sequence slot is needed), never the model itself.
"""

from deepwell.engine.kv.block_pool import BlockPool
from deepwell.engine.kv.layout import KVLayout
from deepwell.engine.kv.slot_pool import SlotPool
from deepwell.engine.request import Request


class KVCacheManager:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, num_slots: int):
        layout.check(block_size)
        self.layout = layout
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.slot_pool = SlotPool(num_slots) if layout.needs_slots else None

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks for `request` to hold its first `num_tokens` tokens."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        if self.slot_pool is not None and request.slot is None and not self.slot_pool.num_free:
            return False
        return self.blocks_needed(request, num_tokens) <= self.block_pool.num_free

    def allocate(self, request: Request, num_tokens: int) -> None:
        if self.slot_pool is not None and request.slot is None:
            request.slot = self.slot_pool.allocate()
        request.block_ids += self.block_pool.allocate(self.blocks_needed(request, num_tokens))

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
