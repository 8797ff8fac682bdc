"""Batch-invariant kernels: a row's result is bitwise the same whatever else is in the batch.

Used when EngineArgs.batch_invariant is on (spec/deepinfer.md §1.6): matmuls over fixed
row tiles, and attention that scores every query row, prefill or decode, block by block.
"""

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.attention import AttentionBackend, AttentionMetadata

# CPU GEMMs (MKL for float32, oneDNN for bf16) pick a row's reduction order from the row
# count: measured, float32 rows differ between 1, 2-7 and >= 8 rows and bf16 rows do not;
# every multiple of 16 rows gives the same bits. Padding costs at most 15 rows per call.
ROW_TILE = 16
# Query-row blocks scored per attention call: bounds the gathered keys and values
# (prefill rows each gather their whole context) at ~100 MB for SmolLM2 in bf16.
MAX_ROW_BLOCKS = 2048


class RowTiledLinear(nn.Linear):
    """nn.Linear over rows zero-padded to a multiple of ROW_TILE."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = x.new_zeros(-(-rows // ROW_TILE) * ROW_TILE, x.shape[1])
        padded[:rows] = x
        return F.linear(padded, self.weight, self.bias)[:rows]


def tile_linears(model: nn.Module) -> None:
    """Turn the model's nn.Linear layers into RowTiledLinear in place (weights untouched)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowTiledLinear


class BatchInvariantAttention(AttentionBackend):
    """Every query row attends over its own context's blocks with fixed-shape ops.

    The runner lays out every row decode-shaped (AttentionMetadata with no prefills): a
    row's scores are per-block [group, head_dim] x [head_dim, block_size] products, its
    softmax sums run over whole blocks then across its blocks in block order, whatever the
    chunking of its prompt or the rows beside it. No SDPA: its kernel choice and reduction
    order depend on the query count.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.prefills:
            raise ValueError("batch-invariant attention needs every row laid out decode-shaped")
        key_cache[meta.slot_blocks, :, meta.slot_offsets] = k
        value_cache[meta.slot_blocks, :, meta.slot_offsets] = v
        block_size = key_cache.shape[2]
        out = torch.empty_like(q)
        first_row = first_block = 0
        num_blocks = 0
        for row, context in enumerate(meta.decode_context_lens):
            num_blocks += -(-context // block_size)
            last = row + 1 == len(meta.decode_context_lens)
            if not last and num_blocks - first_block < MAX_ROW_BLOCKS:
                continue
            blocks = slice(first_block, num_blocks)
            out[first_row : row + 1] = self._attend(
                q[first_row : row + 1],
                key_cache.index_select(0, meta.decode_block_ids[blocks]),
                value_cache.index_select(0, meta.decode_block_ids[blocks]),
                meta.decode_block_rows[blocks] - first_row,
                meta.decode_block_padding[blocks],
            )
            first_row, first_block = row + 1, num_blocks
        return out

    def _attend(self, q, keys, values, rows, padding) -> torch.Tensor:
        """q: [batch, heads, dim]; keys, values: [blocks, kv_heads, block_size, dim]."""
        batch, kv_heads, group = q.shape[0], self.num_kv_heads, self.group
        grouped = (q * self.scale).view(batch, kv_heads, group, self.head_dim)
        scores = torch.matmul(grouped.index_select(0, rows), keys.transpose(-1, -2)).float()
        scores.masked_fill_(padding, float("-inf"))
        index = rows.view(-1, 1, 1).expand(-1, kv_heads, group)
        row_max = torch.full((batch, kv_heads, group), float("-inf"))
        row_max.scatter_reduce_(0, index, scores.amax(dim=-1), "amax")
        weights = torch.exp(scores - row_max.index_select(0, rows).unsqueeze(-1))
        total = torch.zeros(batch, kv_heads, group).index_add_(0, rows, weights.sum(dim=-1))
        partial = torch.matmul(weights.to(q.dtype), values).float()
        out = torch.zeros(batch, kv_heads, group, self.head_dim).index_add_(0, rows, partial)
        out /= total.unsqueeze(-1)
        return out.to(q.dtype).view(batch, self.num_heads, self.head_dim)
