"""V4.1's sink attention in Triton: each query against its window keys and its selected
compressed entries, with a per-head sink in the softmax's denominator (spec §3.3).

The Triton counterpart of layers/sink_attention.py's `TorchSinkAttention`, same interface.
A program takes one query row and a tile of its heads (the keys are one latent shared by
every head, spec §3.3, so a key tile serves them all) and runs an online softmax that starts
from the sink: exp(sink − max) in the denominator, nothing in the numerator. Products run in
float32 at IEEE precision (no TF32), so the result matches the torch path up to summation
order.
"""

import torch
import triton
import triton.language as tl

from deepwell.engine.layers.sink_attention import SinkAttentionBackend

# Keys per tile and heads per program (tl.dot needs every side at least 16): 16 heads of a
# 512-wide latent keep a program's float32 accumulator at 8K values.
KEY_TILE = 32
HEAD_TILE = 16
MIN_DOT = 16


@triton.jit
def _attend_tile(q, keys, seen, scale, best, total, acc):
    """One online-softmax step over a key tile: keys [tile, dim], seen [1, tile] (the row's
    mask, every head's); best/total/acc the running max, denominator and numerator per head."""
    scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
    scores = tl.where(seen, scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    shrink = tl.exp(best - new_best)
    probs = tl.exp(scores - new_best[:, None])
    total = total * shrink + tl.sum(probs, axis=1)
    acc = acc * shrink[:, None] + tl.dot(probs, keys, input_precision="ieee")
    return new_best, total, acc


@triton.jit
def _sink_attention_kernel(
    q_ptr,
    window_ptr,
    visible_ptr,
    selected_ptr,
    valid_ptr,
    sinks_ptr,
    out_ptr,
    num_heads,
    num_window,
    num_selected,
    head_dim,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    tile = tl.arange(0, BLOCK_K)
    head_ok = heads < num_heads
    dim_ok = dims < head_dim
    q_offsets = (row * num_heads + heads[:, None]) * head_dim + dims[None, :]
    q_mask = head_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
    # The sink is finite, so the running max never is −inf and a fully masked tile adds 0.
    best = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    total = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(0, num_window, BLOCK_K):
        index = start + tile
        key_ok = index < num_window
        keys = tl.load(
            window_ptr + index[:, None] * head_dim + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        seen = tl.load(visible_ptr + row * num_window + index, mask=key_ok, other=0) != 0
        best, total, acc = _attend_tile(q, keys, seen[None, :], scale, best, total, acc)
    for start in range(0, num_selected, BLOCK_K):
        index = start + tile
        key_ok = index < num_selected
        keys = tl.load(
            selected_ptr + (row * num_selected + index[:, None]) * head_dim + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        seen = tl.load(valid_ptr + row * num_selected + index, mask=key_ok, other=0) != 0
        best, total, acc = _attend_tile(q, keys, seen[None, :], scale, best, total, acc)
    tl.store(out_ptr + q_offsets, acc / total[:, None], mask=q_mask)


def sink_attention(
    q: torch.Tensor,
    window_keys: torch.Tensor,
    window_visible: torch.Tensor,
    selected_keys: torch.Tensor | None,
    selected_valid: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`SinkAttentionBackend.forward`'s contract with the softmax scale given: q [n, heads,
    dim]; window_keys [keys, dim], window_visible [n, keys]; selected_keys [n, k, dim] with
    selected_valid [n, k], or None; sinks [heads]. Returns [n, heads, dim] in q's dtype."""
    rows, num_heads, head_dim = q.shape
    if window_keys.dim() != 2 or window_keys.shape[1] != head_dim:
        raise ValueError(f"window_keys must be [keys, {head_dim}], got {list(window_keys.shape)}")
    if tuple(window_visible.shape) != (rows, window_keys.shape[0]):
        raise ValueError(
            f"window_visible must be [{rows}, {window_keys.shape[0]}], "
            f"got {list(window_visible.shape)}"
        )
    if selected_keys is None:
        # No compressed entries: an empty selection, the kernel's second loop runs no tile.
        selected_keys = q.new_empty(rows, 0, head_dim)
        selected_valid = torch.empty(rows, 0, dtype=torch.bool, device=q.device)
    elif selected_keys.dim() != 3 or selected_keys.shape[::2] != (rows, head_dim):
        raise ValueError(
            f"selected_keys must be [{rows}, k, {head_dim}], got {list(selected_keys.shape)}"
        )
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if rows:
        _sink_attention_kernel[(rows, triton.cdiv(num_heads, HEAD_TILE))](
            q.contiguous(),
            window_keys.contiguous(),
            window_visible.contiguous().view(torch.uint8),
            selected_keys.contiguous(),
            selected_valid.contiguous().view(torch.uint8),
            sinks.contiguous(),
            out,
            num_heads,
            window_keys.shape[0],
            selected_keys.shape[1],
            head_dim,
            scale,
            BLOCK_H=HEAD_TILE,
            BLOCK_K=KEY_TILE,
            BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        )
    return out.to(q.dtype)


class TritonSinkAttention(SinkAttentionBackend):
    """The sink attention backend of the Triton kernel set."""

    def forward(self, q, window_keys, window_visible, selected_keys, selected_valid, sinks):
        return sink_attention(
            q, window_keys, window_visible, selected_keys, selected_valid, sinks, self.scale
        )
