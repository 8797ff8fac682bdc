"""Paged decode (and verify) attention in Triton: each decode row's query heads of one KV head
attend over the row's blocks, with the softmax carried across blocks (online).

The torch reference is torch_paged.py's `_decode`; prefill chunks and the K/V store stay on that
backend's torch path (SDPA and an indexed write, which run on any device).
"""

from __future__ import annotations

import torch

from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.layers.triton import KernelSetError, require_triton

triton = require_triton()
tl = triton.language

# tl.dot takes operands of at least 16 rows: a KV head's query heads (the GQA group) are padded.
_MIN_DOT_ROWS = 16


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [rows, heads, head_dim]
    key_ptr,  # [num_blocks, kv_heads, block_size, head_dim]
    value_ptr,
    block_ids_ptr,  # the rows' blocks, row by row
    block_starts_ptr,  # [rows + 1] where each row's blocks begin
    context_lens_ptr,  # [rows]
    out_ptr,  # [rows, heads, head_dim]
    scale,
    kv_heads: tl.constexpr,
    group: tl.constexpr,
    padded_group: tl.constexpr,
    head_dim: tl.constexpr,
    block_size: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_heads * group
    g = tl.arange(0, padded_group)
    d = tl.arange(0, head_dim)
    t = tl.arange(0, block_size)
    real = g < group
    q_offsets = row * heads * head_dim + (kv_head * group + g)[:, None] * head_dim + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=real[:, None], other=0.0).to(tl.float32)
    first = tl.load(block_starts_ptr + row)
    last = tl.load(block_starts_ptr + row + 1)
    context = tl.load(context_lens_ptr + row)
    running_max = tl.full((padded_group,), float("-inf"), tl.float32)
    total = tl.zeros((padded_group,), tl.float32)
    acc = tl.zeros((padded_group, head_dim), tl.float32)
    for index in range(first, last):
        block = tl.load(block_ids_ptr + index).to(tl.int64)
        kv_offsets = ((block * kv_heads + kv_head) * block_size + t[:, None]) * head_dim + d[
            None, :
        ]
        # Rows past the context may hold anything (a freed block's old entries): not read.
        inside = ((index - first) * block_size + t) < context
        keys = tl.load(key_ptr + kv_offsets, mask=inside[:, None], other=0.0).to(tl.float32)
        values = tl.load(value_ptr + kv_offsets, mask=inside[:, None], other=0.0).to(tl.float32)
        # float32 products in full precision: a GPU's default (TF32) would round q and k to
        # 10-bit mantissas and part from the CPU path's tokens.
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
        scores = tl.where(inside[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        total = total * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights, values, input_precision="ieee")
        running_max = new_max
    out = acc / total[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=real[:, None])


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the step's decode rows (verify rows included, one row per query), each over
    its own context: q [rows, heads, head_dim] → the same shape, in q's dtype."""
    rows, heads, head_dim = q.shape
    _, kv_heads, block_size, _ = key_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    device = q.device
    _paged_decode_kernel[(rows, kv_heads)](
        q.contiguous(),
        key_cache,
        value_cache,
        meta.decode_block_ids.to(device, non_blocking=True),
        meta.decode_block_starts.to(device, non_blocking=True),
        meta.decode_context_len_tensor.to(device, non_blocking=True),
        out,
        scale,
        kv_heads=kv_heads,
        group=group,
        padded_group=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)),
        head_dim=head_dim,
        block_size=block_size,
    )
    return out


class TritonPagedAttention(TorchPagedAttention):
    """The paged backend of `--kernels triton`: decode and verify rows in the Triton kernel."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        # tl.arange spans powers of two only.
        if head_dim & (head_dim - 1):
            raise KernelSetError(
                f"--kernels triton: paged attention takes power-of-two head dims, this model "
                f"has {head_dim}; use --kernels auto"
            )

    def _decode(self, q, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        return paged_decode(q, key_cache, value_cache, meta, self.scale)
