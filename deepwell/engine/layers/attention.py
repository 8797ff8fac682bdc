"""The attention backend interface and the per-step metadata every backend reads.

Models call `backend.forward` per layer; the CPU torch backend lives in torch_paged.py and
CUDA kernels can implement the same interface.
"""

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from deepwell.engine.device import long_tensor


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk: rows [start, start + length) of the step's tokens."""

    start: int
    length: int
    # Tokens visible to the chunk's last query (cached context + the chunk itself).
    context_len: int
    # Block ids covering context_len tokens.
    block_table: torch.Tensor
    # [length, context_len] visibility, None when the chunk is the whole context (causal).
    mask: torch.Tensor | None


@dataclass
class QueryTiles:
    """Batch-invariant layout of a step's rows of one kind, one-row (decodes) or chunk tiles:
    tiles of one sequence's rows, each paired with every KV block its last row sees
    (layers/batch_invariant.py)."""

    # [tiles, width] step row of each tile slot; -1 for a padding slot.
    rows: torch.Tensor
    # Per (tile, block) pair, tiles in order and each tile's blocks in block order.
    pair_tiles: torch.Tensor
    pair_blocks: torch.Tensor
    # [pairs, width, block_size] True where a key lies past the slot's position.
    pair_masks: torch.Tensor
    # Pairs of each tile, to split a step into bounded pieces at tile boundaries.
    tile_num_pairs: list[int]
    # Block ids below this bound hold every pair's block, each block in one pair only (a
    # step of decodes): the pool's front can be scored in place. None otherwise.
    pair_block_span: int | None = None


@dataclass
class RowBlockLists:
    """Batch-invariant layout of a step's rows for the C++ paged kernel (paged_decode.cpp):
    every row, prefill or decode, reads its own sequence's blocks up to its own position, in
    block order (layers/batch_invariant.py)."""

    # The blocks of every row, row by row; where each row's begin [rows + 1].
    block_ids: torch.Tensor
    block_starts: torch.Tensor
    # [rows] keys each row attends (its position + 1).
    context_lens: torch.Tensor
    # [sequences + 1] where each sequence's rows begin (they share its blocks).
    sequence_starts: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each query may see.

    Decode rows come first (one token per sequence), then prefill spans; built once per step.
    The decode rows are host lists; the tensors backends read of them (the kernels' block
    ids and starts; the torch path's block rows, padding and stacking) are derived on first
    use, where the step's tensors lie, so a step builds only what its backend reads (all of
    them took 0.15 of a batch-1 decode step's ~0.6 ms of Python).
    """

    # Block id and offset in the block of every token of the step.
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    num_decodes: int
    # Context length (keys to attend) of each decode row.
    decode_context_lens: list[int]
    # The blocks of all decode rows, row by row (ragged: no padding blocks).
    decode_blocks: list[int]
    block_size: int
    prefills: list[PrefillSpan]
    # Per row: its sequence's state slot (-1 without one), and the position its sequence
    # restarted from at admission (its prefix hit), for a model's own ring layers: a ring
    # holds no valid entry before that position.
    seq_slots: list[int] = field(default_factory=list)
    seq_starts: list[int] = field(default_factory=list)
    # Set in batch-invariant mode, which lays out no decode rows or prefill spans.
    query_tiles: list[QueryTiles] | None = None
    row_block_lists: RowBlockLists | None = None
    # Decode rows per sequence, in row order (a draft's verify rows are one sequence's, at
    # consecutive positions); None: one row each.
    decode_sequence_rows: list[int] | None = None

    @cached_property
    def decode_block_counts(self) -> list[int]:
        """Blocks each decode row reads."""
        return [-(-length // self.block_size) for length in self.decode_context_lens]

    @cached_property
    def decode_block_ids(self) -> torch.Tensor:
        """decode_blocks as an int64 tensor."""
        return self._decode_tensor(self.decode_blocks)

    @cached_property
    def decode_context_len_tensor(self) -> torch.Tensor:
        """decode_context_lens as an int64 tensor."""
        return self._decode_tensor(self.decode_context_lens)

    @cached_property
    def decode_block_starts(self) -> torch.Tensor:
        """[num_decodes + 1]: where each decode row's blocks begin in decode_block_ids."""
        return self._decode_tensor([0, *itertools.accumulate(self.decode_block_counts)])

    @cached_property
    def decode_block_rows(self) -> torch.Tensor:
        """The decode row each of decode_block_ids belongs to (decode rows are the step's
        first rows, so a decode index is a row index)."""
        counts = self.decode_block_counts
        return self._decode_tensor([row for row, n in enumerate(counts) for _ in range(n)])

    @cached_property
    def decode_block_padding(self) -> torch.Tensor:
        """[blocks, 1, 1, block_size] True where a key lies past its row's context."""
        bs = self.block_size
        valid = []
        for length, n in zip(self.decode_context_lens, self.decode_block_counts, strict=True):
            valid += [bs] * (n - 1) + [length - (n - 1) * bs]
        keys = torch.arange(bs, device=self.slot_blocks.device)
        return (keys.unsqueeze(0) >= self._decode_tensor(valid).unsqueeze(1))[:, None, None]

    @cached_property
    def decode_block_stacking(self) -> tuple[torch.Tensor, int, int]:
        """Per decode block, how many decode blocks before it have its id (rows sharing a
        block: a draft's verify rows, a shared prefix); the highest plus one (the stacking
        depth); and the bound below which all decode block ids lie."""
        seen: dict[int, int] = {}
        ranks = []
        for block in self.decode_blocks:
            ranks.append(seen.get(block, 0))
            seen[block] = ranks[-1] + 1
        return self._decode_tensor(ranks), max(seen.values(), default=1), max(seen, default=-1) + 1

    @cached_property
    def decode_sequence_starts(self) -> torch.Tensor:
        """[sequences + 1]: where each sequence's decode rows begin."""
        if self.decode_sequence_rows is None:
            return torch.arange(self.num_decodes + 1, device=self.slot_blocks.device)
        return self._decode_tensor([0, *itertools.accumulate(self.decode_sequence_rows)])

    def _decode_tensor(self, values: list[int]) -> torch.Tensor:
        """An int64 tensor of `values` where the step's tensors lie."""
        return long_tensor(values).to(self.slot_blocks.device)


@dataclass
class FixedDecodeMetadata:
    """A step of single-token decodes in shapes set by its row count alone (decode graphs,
    engine/decode_graphs.py): every per-row value is a tensor and nothing the forward reads
    is a host value, so one captured graph serves every such step of that many rows."""

    # [rows]: the block and offset of the cache slot each row's key and value go to.
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    # [rows, max_blocks_per_seq]: each row's blocks, padded past its context with block 0
    # (any block: the keys there are masked out).
    block_tables: torch.Tensor
    # [rows]: keys each row attends, its position + 1.
    context_lens: torch.Tensor


class AttentionBackend(ABC):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store k, v of the step's tokens in the caches, then attend.

        q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim];
        caches: [num_blocks, kv_heads, block_size, head_dim]. Returns q's shape.
        """

    def decode_fixed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FixedDecodeMetadata,
    ) -> torch.Tensor:
        """`forward` for a decode-graph step: store, then attend every row over its padded
        block table with the keys past its context masked, in shapes fixed by the row count
        (the work grows with max_blocks_per_seq, not the contexts: the price of a graph).
        Shared by every backend; a device's backend may override it with its own kernel."""
        key_cache[meta.slot_blocks, :, meta.slot_offsets] = k
        value_cache[meta.slot_blocks, :, meta.slot_offsets] = v
        rows, max_blocks = meta.block_tables.shape
        block_size = key_cache.shape[2]
        # [rows, max_blocks, kv_heads, block_size, dim] → [rows, kv_heads, keys, dim]
        keys = key_cache[meta.block_tables].transpose(1, 2).flatten(2, 3)
        values = value_cache[meta.block_tables].transpose(1, 2).flatten(2, 3)
        positions = torch.arange(max_blocks * block_size, device=q.device)
        visible = positions.unsqueeze(0) < meta.context_lens.unsqueeze(1)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=visible[:, None, None, :], enable_gqa=True
        )
        return out.view(rows, self.num_heads, self.head_dim)
