"""Paged attention on CPU in plain torch: scatter new K/V by slot, gather by block table.

Decodes run as one batched SDPA (queries of a KV head folded into the query axis, so no
K/V repeat for GQA); each prefill chunk runs its own SDPA.
"""

import torch
import torch.nn.functional as F

from deepwell.engine.layers.attention import AttentionBackend, AttentionMetadata


class TorchPagedAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.group = num_heads // num_kv_heads

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_blocks, block_size = kv_cache.shape[:2]
        flat_cache = kv_cache.view(num_blocks * block_size, *kv_cache.shape[2:])
        flat_cache.index_copy_(0, meta.slot_mapping, torch.stack((k, v), dim=1))
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], kv_cache, meta)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            if span.mask is None:
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:
                keys, values = self._gather(kv_cache, span.block_table, span.context_len)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                keys,
                values,
                attn_mask=span.mask,
                is_causal=span.mask is None,
                enable_gqa=True,
            ).transpose(0, 1)
        return out

    def _gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int):
        kv = kv_cache[block_table].flatten(0, 1)[:context_len]  # [ctx, 2, kv_heads, dim]
        return kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
        batch = q.shape[0]
        kv = kv_cache[meta.decode_block_tables].flatten(1, 2)  # [B, L, 2, kv_heads, dim]
        keys = kv[:, :, 0].transpose(1, 2)
        values = kv[:, :, 1].transpose(1, 2)
        grouped = q.view(batch, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=meta.decode_mask)
        return out.reshape(batch, self.num_heads, self.head_dim)
