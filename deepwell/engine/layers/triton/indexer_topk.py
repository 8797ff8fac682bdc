"""The lightning indexer's top-k in Triton: per row of scores, the ids of the k largest,
ascending, −1 where the chosen score is −inf (fewer entries visible than k).

The Triton counterpart of the selection in models/deepseek_v41/attention.py's `Indexer`
(and of its candidate pool's block ranking). Ties go to the lower id, as the batch-invariant
path's `top_indices` breaks them. No sort: each row bisects the k-th largest score over the
scores' order-preserving integer keys (32 counting passes), then one pass keeps every score
above it and the lowest-id ties at it, writing each kept id at its rank among the kept.
"""

import torch
import triton
import triton.language as tl

TILE = 128
# Bisection bounds: every int32 key lies in [lowest, highest].
KEY_BITS = 32


@triton.jit
def _ordered_keys(scores):
    """int64 keys ordered as the float32 scores are: a float's bits, the negative ones'
    magnitude bits flipped; −0 counts as +0 (they compare equal, so they tie)."""
    scores = tl.where(scores == 0.0, 0.0, scores)
    bits = scores.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _count_at_least(row_ptr, width, threshold, TILE: tl.constexpr):
    count = tl.zeros([], tl.int64)
    for start in range(0, width, TILE):
        index = start + tl.arange(0, TILE)
        scores = tl.load(row_ptr + index, mask=index < width, other=float("-inf"))
        keys = tl.where(index < width, _ordered_keys(scores), -(2**40))
        count += tl.sum((keys >= threshold).to(tl.int64), axis=0)
    return count


@triton.jit
def _top_k_ids_kernel(scores_ptr, out_ptr, width, k, KEY_BITS: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * width
    # The k-th largest key: the largest threshold that at least k keys reach.
    low = tl.full([], -(2**31), tl.int64)
    high = tl.full([], 2**31 - 1, tl.int64)
    for _ in range(KEY_BITS):
        middle = (low + high + 1) // 2
        enough = _count_at_least(row_ptr, width, middle, TILE) >= k
        low = tl.where(enough, middle, low)
        high = tl.where(enough, high, middle - 1)
    # Ties at the threshold fill what the keys above it leave, lowest id first.
    ties_wanted = k - _count_at_least(row_ptr, width, low + 1, TILE)
    ties_taken = tl.zeros([], tl.int64)
    written = tl.zeros([], tl.int64)
    for start in range(0, width, TILE):
        index = start + tl.arange(0, TILE)
        inside = index < width
        scores = tl.load(row_ptr + index, mask=inside, other=float("-inf"))
        keys = _ordered_keys(scores)
        tie = inside & (keys == low)
        tie_rank = ties_taken + tl.cumsum(tie.to(tl.int64), axis=0) - 1
        kept = inside & ((keys > low) | (tie & (tie_rank < ties_wanted)))
        ties_taken += tl.sum(tie.to(tl.int64), axis=0)
        rank = written + tl.cumsum(kept.to(tl.int64), axis=0) - 1
        ids = tl.where(scores > float("-inf"), index.to(tl.int64), -1)
        tl.store(out_ptr + row * k + rank, ids, mask=kept)
        written += tl.sum(kept.to(tl.int64), axis=0)


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [rows, k]: per row of float32 scores [rows, width] the ids of its k largest,
    ascending, ties to the lower id, −1 where the chosen score is −inf (0 < k ≤ width)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(
            f"scores must be float32 [rows, width], got {scores.dtype} {list(scores.shape)}"
        )
    if not 0 < k <= scores.shape[1]:
        raise ValueError(f"k must be in 1..{scores.shape[1]} (the row width), got {k}")
    out = torch.empty(scores.shape[0], k, dtype=torch.int64, device=scores.device)
    if scores.shape[0]:
        _top_k_ids_kernel[(scores.shape[0],)](
            scores.contiguous(), out, scores.shape[1], k, KEY_BITS=KEY_BITS, TILE=TILE
        )
    return out
