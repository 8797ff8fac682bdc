"""Paged attention on CPU in plain torch: scatter new K/V by slot, gather by block table.

Decodes run batched and block-wise: keys are gathered as whole head-major blocks (one
memcpy per block) and scored block by block, so no further copy of K/V is needed; each
prefill chunk runs its own SDPA.
"""

import torch
import torch.nn.functional as F

from deepwell.engine.layers.attention import AttentionBackend, AttentionMetadata


class TorchPagedAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        key_cache[meta.slot_blocks, :, meta.slot_offsets] = k
        value_cache[meta.slot_blocks, :, meta.slot_offsets] = v
        if not meta.prefills:
            return self._decode(q, key_cache, value_cache, meta)
        out = torch.empty_like(q)
        if meta.num_decodes:
            decodes = q[: meta.num_decodes]
            out[: meta.num_decodes] = self._decode(decodes, key_cache, value_cache, meta)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            if span.mask is None:
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:
                keys = _gather(key_cache, span.block_table, span.context_len)
                values = _gather(value_cache, span.block_table, span.context_len)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                keys,
                values,
                attn_mask=span.mask,
                is_causal=span.mask is None,
                enable_gqa=True,
            ).transpose(0, 1)
        return out

    def _decode(self, q, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        tables = meta.decode_block_tables
        batch, num_blocks = tables.shape
        kv_heads, block_size = key_cache.shape[1:3]
        ids = tables.flatten()
        # [batch, blocks, kv_heads, block_size, head_dim]
        keys = key_cache.index_select(0, ids).view(batch, num_blocks, kv_heads, block_size, -1)
        values = value_cache.index_select(0, ids).view(batch, num_blocks, kv_heads, block_size, -1)
        # A KV head's query heads are folded into one [group, head_dim] matrix (GQA).
        grouped = (q * self.scale).view(batch, 1, kv_heads, self.group, self.head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2))  # [b, blocks, kvh, group, bs]
        scores = scores.float().permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, self.group, -1)
        scores.masked_fill_(meta.decode_padding, float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype)
        probs = probs.view(batch, kv_heads, self.group, num_blocks, block_size).permute(
            0, 3, 1, 2, 4
        )
        out = torch.matmul(probs, values).sum(dim=1)  # [b, kvh, group, head_dim]
        return out.reshape(batch, self.num_heads, self.head_dim)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """[kv_heads, context_len, head_dim] of one sequence."""
    blocks = cache.index_select(0, block_table)  # [blocks, kv_heads, block_size, head_dim]
    return blocks.transpose(0, 1).flatten(1, 2)[:, :context_len]
