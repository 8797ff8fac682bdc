"""Paged attention on CPU in plain torch: scatter new K/V by slot, gather by block table.

Decodes run batched over a ragged list of blocks (no padding blocks), scored block by
block with the softmax reduced per row across its blocks: either in place over the front
of the pool (rows sharing a block stacked over it), or on whole head-major blocks gathered
with one memcpy each. Each prefill chunk runs its own SDPA.
"""

import torch
import torch.nn.functional as F

from deepwell.engine.layers import cpu_sdpa
from deepwell.engine.layers.attention import AttentionBackend, AttentionMetadata, PrefillSpan

# Scoring the pool in place reads `span` blocks once, with `depth` stacked queries each;
# gathering reads, writes and rereads the decode blocks. In place wins while
# span x depth <= 3 x decode blocks (measured on W's decode steps, drafts stacked 6 deep).
IN_PLACE_SPAN_FACTOR = 3


class TorchPagedAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        self._store(k, v, key_cache, value_cache, meta)
        if not meta.prefills:
            return self._decode(q, key_cache, value_cache, meta)
        out = torch.empty_like(q)
        if meta.num_decodes:
            decodes = q[: meta.num_decodes]
            out[: meta.num_decodes] = self._decode(decodes, key_cache, value_cache, meta)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], key_cache, value_cache, span)
        return out

    def _prefill(self, q, k, v, key_cache, value_cache, span: PrefillSpan) -> torch.Tensor:
        """One prefill chunk's rows [length, heads, head_dim] over its context, whose keys
        and values (the chunk's own among them) are already in the caches."""
        if span.mask is None:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            keys = gather(key_cache, span.block_table, span.context_len)
            values = gather(value_cache, span.block_table, span.context_len)
        # 4-d inputs: torch's CPU flash kernel takes only those (3-d runs the unfused
        # math path, 2.5x slower on W's prefills).
        return cpu_sdpa.attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            enable_gqa=True,
        )[0].transpose(0, 1)

    def _store(self, k, v, key_cache, value_cache, meta: AttentionMetadata) -> None:
        key_cache[meta.slot_blocks, :, meta.slot_offsets] = k
        value_cache[meta.slot_blocks, :, meta.slot_offsets] = v

    def _decode(self, q, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        """All decode rows at once, block by block over their real blocks only.

        Softmax runs across each row's blocks: per-row max and sum are reduced over the
        row's blocks, so no row is padded to the longest context.
        """
        ids = meta.decode_block_ids
        batch, kv_heads, group = meta.num_decodes, self.num_kv_heads, self.group
        if batch == 1:
            # Latency path: one sequence needs no cross-row reductions, and a third of the
            # ops matter at batch 1, where every op's fixed cost shows.
            context = meta.decode_context_lens[0]
            keys = gather(key_cache, ids, context)
            values = gather(value_cache, ids, context)
            grouped = q.view(kv_heads, group, self.head_dim)
            out = F.scaled_dot_product_attention(grouped, keys, values)
            return out.view(1, self.num_heads, self.head_dim)
        # A KV head's query heads are folded into one [group, head_dim] matrix (GQA).
        grouped = (q * self.scale).view(batch, kv_heads, group, self.head_dim)
        rows = meta.decode_block_rows
        ranks, depth, span = meta.decode_block_stacking
        in_place = span * depth <= IN_PLACE_SPAN_FACTOR * ids.numel()
        if in_place:
            # Score the first `span` pool blocks where they lie (a read, no copy). A block
            # seen by several rows (a draft's verify rows, a shared prefix) gets one query
            # per row, stacked `depth` deep; stack slots no row uses hold zero queries and
            # are dropped right after.
            stacked = (span, kv_heads, depth, group)
            queries = q.new_zeros(*stacked, self.head_dim)
            queries[ids, :, ranks] = grouped.index_select(0, rows)
            scores = _scores(
                queries.view(span, kv_heads, depth * group, self.head_dim), key_cache[:span]
            )
            scores = scores.view(*stacked, -1)[ids, :, ranks]
        else:
            keys = key_cache.index_select(0, ids)  # [blocks, kv_heads, block_size, head_dim]
            scores = _scores(grouped.index_select(0, rows), keys)
        scores.masked_fill_(meta.decode_block_padding, float("-inf"))
        index = rows.view(-1, 1, 1).expand(-1, kv_heads, group)
        row_max = torch.full((batch, kv_heads, group), float("-inf"), device=q.device)
        row_max.scatter_reduce_(0, index, scores.amax(dim=-1), "amax")
        weights = torch.exp(scores - row_max.index_select(0, rows).unsqueeze(-1))
        total = torch.zeros(batch, kv_heads, group, device=q.device).index_add_(
            0, rows, weights.sum(dim=-1)
        )
        if in_place:
            block_size = weights.shape[-1]
            spread = weights.new_zeros(*stacked, block_size, dtype=q.dtype)
            spread[ids, :, ranks] = weights.to(q.dtype)
            partial = torch.matmul(
                spread.view(span, kv_heads, depth * group, block_size), value_cache[:span]
            )
            partial = partial.view(*stacked, self.head_dim)[ids, :, ranks].float()
        else:
            values = value_cache.index_select(0, ids)
            partial = torch.matmul(weights.to(q.dtype), values).float()  # [blocks, kvh, group, dim]
        out = torch.zeros(batch, kv_heads, group, self.head_dim, device=q.device).index_add_(
            0, rows, partial
        )
        out /= total.unsqueeze(-1)
        return out.to(q.dtype).view(batch, self.num_heads, self.head_dim)


def _scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float32 [..., queries, keys] of bf16/float32 [..., queries, dim] x [..., keys, dim].

    Computed as keys x queries^T: with a block's 128 keys as the rows and its few stacked
    queries (a GQA group) as the columns, torch's CPU batched matmul runs 2.3x faster on
    W's decode steps (bf16, 256 blocks x 3 KV heads x 3 queries: 1.2 ms against 2.7 ms with
    the float32 copy) than queries x keys^T, which was 43% of a 64-request decode step.
    """
    scores = torch.matmul(keys, queries.transpose(-1, -2)).transpose(-1, -2)
    return scores.to(torch.float32, memory_format=torch.contiguous_format)


def gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """[kv_heads, context_len, head_dim] of one sequence, from the blocks that hold them (a
    table may run past: a continued chunk's prior keys are its context's first ones)."""
    needed = -(-context_len // cache.shape[2])
    # [blocks, kv_heads, block_size, head_dim]
    blocks = cache.index_select(0, block_table[:needed])
    return blocks.transpose(0, 1).flatten(1, 2)[:, :context_len]
