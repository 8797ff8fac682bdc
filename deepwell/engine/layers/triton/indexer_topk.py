"""The lightning indexer's top-k in Triton: per row of scores, the ids of the k largest,
ascending, −1 where the chosen score is −inf (fewer entries visible than k).

The Triton counterpart of the selection in models/deepseek_v41/attention.py's `Indexer`
(and of its candidate pool's block ranking). Ties go to the lower id, as the batch-invariant
path's `top_indices` breaks them. No sort: a program takes a few rows and bisects each row's
k-th largest score over the scores' order-preserving integer keys (32 counting passes over
the row), then one pass keeps every score above it and the lowest-id ties at it, writing
each kept id at its rank among the kept.
"""

import torch
import triton
import triton.language as tl

# Rows per program; columns per tile. A row that fits one tile is loaded once and bisected
# in registers, a longer one is read again on each of the 32 passes.
ROWS = 16
TILE = 256
# Bisection steps: one per bit of the int32 keys.
KEY_BITS = 32


@triton.jit
def _ordered_keys(scores):
    """int64 keys ordered as the float32 scores are: a float's bits, the negative ones'
    magnitude bits flipped; −0 counts as +0 (they compare equal, so they tie)."""
    scores = tl.where(scores == 0.0, 0.0, scores)
    bits = scores.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _load_keys(scores_ptr, row, row_ok, width, start, TILE: tl.constexpr):
    """The keys of one tile of the rows, below every int32 key outside them."""
    column = start + tl.arange(0, TILE)
    inside = row_ok[:, None] & (column < width)[None, :]
    scores = tl.load(scores_ptr + row[:, None] * width + column[None, :], mask=inside, other=0.0)
    return tl.where(inside, _ordered_keys(scores), -(2**40)), scores, column, inside


@triton.jit
def _count_at_least(scores_ptr, row, row_ok, width, threshold, TILE: tl.constexpr):
    count = tl.zeros_like(threshold)
    for start in range(0, width, TILE):
        keys, _, _, _ = _load_keys(scores_ptr, row, row_ok, width, start, TILE)
        count += tl.sum((keys >= threshold[:, None]).to(tl.int64), axis=1)
    return count


@triton.jit
def _top_k_ids_kernel(
    scores_ptr,
    out_ptr,
    rows,
    width,
    k,
    KEY_BITS: tl.constexpr,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    WHOLE_ROW: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    row = row.to(tl.int64)
    # Each row's k-th largest key: the largest threshold that at least k keys reach.
    low = tl.full([ROWS], -(2**31), tl.int64)
    high = tl.full([ROWS], 2**31 - 1, tl.int64)
    if WHOLE_ROW:
        keys, _, _, _ = _load_keys(scores_ptr, row, row_ok, width, 0, TILE)
        for _ in range(KEY_BITS):
            middle = (low + high + 1) // 2
            enough = tl.sum((keys >= middle[:, None]).to(tl.int64), axis=1) >= k
            low = tl.where(enough, middle, low)
            high = tl.where(enough, high, middle - 1)
    else:
        for _ in range(KEY_BITS):
            middle = (low + high + 1) // 2
            enough = _count_at_least(scores_ptr, row, row_ok, width, middle, TILE) >= k
            low = tl.where(enough, middle, low)
            high = tl.where(enough, high, middle - 1)
    # Ties at the threshold fill what the keys above it leave, lowest id first.
    ties_wanted = k - _count_at_least(scores_ptr, row, row_ok, width, low + 1, TILE)
    ties_taken = tl.zeros([ROWS], tl.int64)
    written = tl.zeros([ROWS], tl.int64)
    for start in range(0, width, TILE):
        keys, scores, column, inside = _load_keys(scores_ptr, row, row_ok, width, start, TILE)
        tie = inside & (keys == low[:, None])
        tie_rank = ties_taken[:, None] + tl.cumsum(tie.to(tl.int64), axis=1) - 1
        kept = inside & ((keys > low[:, None]) | (tie & (tie_rank < ties_wanted[:, None])))
        ties_taken += tl.sum(tie.to(tl.int64), axis=1)
        rank = written[:, None] + tl.cumsum(kept.to(tl.int64), axis=1) - 1
        ids = tl.where(scores > float("-inf"), column.to(tl.int64)[None, :], -1)
        tl.store(out_ptr + row[:, None] * k + rank, ids, mask=kept)
        written += tl.sum(kept.to(tl.int64), axis=1)


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [rows, k]: per row of float32 scores [rows, width] the ids of its k largest,
    ascending, ties to the lower id, −1 where the chosen score is −inf (0 < k ≤ width)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(
            f"scores must be float32 [rows, width], got {scores.dtype} {list(scores.shape)}"
        )
    rows, width = scores.shape
    if not 0 < k <= width:
        raise ValueError(f"k must be in 1..{width} (the row width), got {k}")
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows:
        _top_k_ids_kernel[(triton.cdiv(rows, ROWS),)](
            scores.contiguous(),
            out,
            rows,
            width,
            k,
            KEY_BITS=KEY_BITS,
            TILE=min(TILE, triton.next_power_of_2(width)),
            ROWS=ROWS,
            WHOLE_ROW=width <= TILE,
        )
    return out
