"""A continued prefill chunk's attention on the CPU in two blocks, merged exactly: the chunk's
queries over the cached prefix (every key visible) and over the chunk itself (causal).

The single masked call it replaces scores every (query, key) pair of the chunk's context,
the masked-out half of the chunk's own square included, and first turns a [rows, context]
mask into an additive float one each layer; at 16k tokens in 2,048-token chunks that took
15-20 % more CPU time than one causal call over the whole prompt, which the two blocks match
(docs/benchmarks-log.md, "prefill at 512, 4k and 16k tokens").
"""

import torch

# torch's CPU flash-attention kernel, the one F.scaled_dot_product_attention picks for 4-d CPU
# inputs, called directly for its log-sum-exp of each query row: the merge needs it.
_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def continued_chunk_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int, scale: float
) -> torch.Tensor:
    """Attention of a prefill chunk whose first query sits at position `cached`.

    q: [rows, heads, dim], the chunk's queries; keys, values: [kv_heads, cached + rows, dim],
    the whole context, the chunk's own rows last. Query row i sees keys 0 .. cached + i.
    Returns [rows, heads, dim] in q's dtype.
    """
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    queries = q.transpose(0, 1)  # [heads, rows, dim]
    # The chunk over itself, causal. The kernel takes no GQA: each KV head's rows of the
    # chunk are repeated for its query heads (a copy of the chunk's rows only).
    own_keys = keys[:, cached:].repeat_interleave(group, dim=0)
    own_values = values[:, cached:].repeat_interleave(group, dim=0)
    own, own_lse = _flash_attention(
        queries.unsqueeze(0),
        own_keys.unsqueeze(0),
        own_values.unsqueeze(0),
        is_causal=True,
        scale=scale,
    )
    # The chunk over the prefix, all visible: a KV head's query heads fold into one block of
    # group x rows queries against its keys, so the prefix is read once per KV head.
    folded = queries.reshape(kv_heads, group * rows, dim)
    prefix, prefix_lse = _flash_attention(
        folded.unsqueeze(0),
        keys[:, :cached].unsqueeze(0),
        values[:, :cached].unsqueeze(0),
        scale=scale,
    )
    prefix = prefix.reshape(heads, rows, dim)
    prefix_lse = prefix_lse.reshape(heads, rows)
    own_lse = own_lse.reshape(heads, rows)
    # softmax over both blocks = each block's softmax weighted by its share of the total
    # exp-sum, exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b).
    prefix_share = torch.sigmoid(prefix_lse - own_lse).unsqueeze(-1)
    merged = own[0].float().lerp_(prefix.float(), prefix_share)
    return merged.to(q.dtype).transpose(0, 1)
