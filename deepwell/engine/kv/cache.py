"""KVCache: the tensors behind a KVLayout, and how many blocks a memory budget buys.

One tensor per spec and layer; the block id (or slot id) is the leading dimension.
"""

import math
import mmap
from dataclasses import dataclass

import torch

from deepwell.engine.device import HOST
from deepwell.engine.errors import MemoryBudgetError
from deepwell.engine.kv.layout import KVLayout
from deepwell.settings.engine import ACTIVATION_RESERVE

GIB = 1 << 30


@dataclass
class KVCache:
    # spec name → one tensor per layer: [num_blocks, *spec.block_shape(block_size)]
    paged: dict[str, list[torch.Tensor]]
    # spec name → one tensor per layer: [num_slots, rows, *entry_shape]
    rings: dict[str, list[torch.Tensor]]
    # spec name → one tensor per layer: [num_slots, *state_shape]
    states: dict[str, list[torch.Tensor]]
    # Per block, 1 once it may hold rows (handed out cleared or written), 0 while it is as
    # allocated: zero on the CPU, where the paged tensors are anonymous mappings; elsewhere
    # the allocator's memory holds anything, and every block starts at 1.
    holds_rows: bytearray

    @classmethod
    def allocate(
        cls,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device = HOST,
    ) -> "KVCache":
        """Tensors left as the allocator hands them: nothing is written up front, so a start
        does not wait on the budget, and on a CPU host a large pool comes as fresh pages that
        become resident only as blocks are written. Readers never see what they held:
        `KVCacheManager` clears each block and slot as it hands it out (`clear_blocks`,
        `clear_slot`); a masked read of an unwritten row would otherwise turn NaN * 0 into
        NaN (tests/engine/kv/test_unwritten_rows.py). On the CPU the paged tensors are
        anonymous mappings, whose pages the kernel zeroes as they are first touched: a block
        never handed out needs no clear, and its pages are not touched before its rows are
        written (a request's last block, partly filled, leaves the rest untouched)."""

        def empty(spec, *shape: int) -> list[torch.Tensor]:
            return [
                torch.empty(shape, dtype=spec.dtype or dtype, device=device)
                for _ in range(spec.num_layers)
            ]

        def zero_pages(spec, *shape: int) -> list[torch.Tensor]:
            return [_zero_pages(shape, spec.dtype or dtype) for _ in range(spec.num_layers)]

        on_host = device.type == "cpu"
        paged = zero_pages if on_host else empty
        return cls(
            paged={s.name: paged(s, num_blocks, *s.block_shape(block_size)) for s in layout.paged},
            rings={r.name: empty(r, num_slots, r.rows, *r.entry_shape) for r in layout.rings},
            states={s.name: empty(s, num_slots, *s.state_shape) for s in layout.states},
            holds_rows=bytearray(num_blocks) if on_host else bytearray(b"\x01" * num_blocks),
        )

    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero the blocks a request is about to be given: those that may hold rows (a block
        still as allocated on the CPU is zero already)."""
        holds_rows = self.holds_rows
        stale = [b for b in block_ids if holds_rows[b]]
        for block_id in block_ids:
            holds_rows[block_id] = 1
        if not stale:
            return
        tensors = self.block_tensors()
        index = torch.tensor(stale, dtype=torch.long, device=tensors[0].device)
        for tensor in tensors:
            tensor.index_fill_(0, index, 0)

    def clear_slot(self, slot: int) -> None:
        """Zero a slot's rings and state before a request takes it."""
        for tensors in (*self.rings.values(), *self.states.values()):
            for tensor in tensors:
                tensor[slot].zero_()

    def block_tensors(self) -> list[torch.Tensor]:
        """Every paged tensor, spec by spec and layer by layer: the order of a block's parts."""
        return [tensor for tensors in self.paged.values() for tensor in tensors]

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """A copy of the blocks' contents: one [len(block_ids), *block_shape] per part."""
        tensors = self.block_tensors()
        index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
        return [tensor.index_select(0, index) for tensor in tensors]

    def write_blocks(self, block_ids: list[int], blocks: list[list[torch.Tensor]]) -> None:
        """Fill blocks from their parts (one list of `block_tensors` shapes per block)."""
        for block_id in block_ids:
            self.holds_rows[block_id] = 1
        tensors = self.block_tensors()
        index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
        for part, tensor in enumerate(tensors):
            tensor[index] = torch.stack([block[part] for block in blocks])


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor on a private anonymous mapping: zero, each page resident (and zeroed by
    the kernel) only once touched. The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    # A zero-length mapping is refused: one page stands in for an empty tensor.
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def plan_num_blocks(
    layout: KVLayout,
    *,
    memory_gib: float,
    model_bytes: int,
    block_size: int,
    num_slots: int,
    dtype: torch.dtype,
    max_model_len: int,
    reserved_bytes: int = 0,
) -> int:
    """Blocks that fit beside the weights, the slots and `reserved_bytes` (ring snapshots);
    at least one full-length sequence must fit."""
    budget = int(memory_gib * GIB * (1 - ACTIVATION_RESERVE))
    available = budget - model_bytes - num_slots * layout.slot_bytes(dtype) - reserved_bytes
    block_bytes = layout.block_bytes(block_size, dtype)
    num_blocks = max(0, available // block_bytes)
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        need_gib = (model_bytes + needed * block_bytes) / GIB / (1 - ACTIVATION_RESERVE)
        raise MemoryBudgetError(
            f"memory budget {memory_gib:.2f} GiB is too small: weights take "
            f"{model_bytes / GIB:.2f} GiB and one {max_model_len}-token sequence needs "
            f"{needed} KV blocks of {block_bytes / 2**20:.2f} MiB; raise the budget to at "
            f"least {need_gib:.2f} GiB or lower max_model_len"
        )
    return int(num_blocks)
