"""The grouped MXFP4 expert GEMM in Triton: one MoE layer's routed experts over all of a
step's (token, expert) pairs, W2(silu(min(W1 x, limit)) · clamp(W3 x, ±limit)) · weight.

The Triton counterpart of layers/blockscaled.py's `mxfp4_experts`, same interface. Pairs are
sorted by expert on the device, and a table of row tiles (each within one expert's pairs)
is built there too, sized for the worst case, so there is no host synchronisation; two
kernels then run a grid of (row tile, output tile) programs, each reading its expert's
weights through `MxFp4Experts`'s address tables (a `tl.pointer_type` cast, so
the separately mapped expert tensors are never stacked). The first kernel writes the clamped
SwiGLU activations of the sorted pairs, the second multiplies them by W2 and the routing
weight into each pair's own row. Each packed byte holds two inputs (even one in the low
nibble): the even and odd inputs are multiplied as two halves, E2M1 and E8M0 decoded from
the bytes (triton/encodings.py). Products are float32 at IEEE precision.
"""

import torch
import triton
import triton.language as tl

from deepwell.engine.layers.blockscaled import BLOCK, MxFp4Experts, _check_pairs
from deepwell.engine.layers.triton.encodings import decode_e2m1, decode_e8m0
from deepwell.engine.layers.triton.fp8_block_gemm import MIN_DOT, tile_size

# Pairs per row tile; largest output and input tiles (smaller where the matrix is).
ROW_TILE = 16
OUT_TILE = 64
IN_TILE = 128


@triton.jit
def _packed_product(
    rows_ptr,
    row_ok,
    in_features,
    table_ptr,
    scale_table_ptr,
    expert,
    output,
    output_ok,
    active,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] float32: rows [BLOCK_M, in_features] (pointers to their first
    input) times the rows `output` of expert `expert`'s MXFP4 matrix, transposed."""
    weight_ptr = tl.load(table_ptr + expert).to(tl.pointer_type(tl.uint8))
    scale_ptr = tl.load(scale_table_ptr + expert).to(tl.pointer_type(tl.uint8))
    half = in_features // 2
    scale_columns = tl.cdiv(in_features, SCALE_BLOCK)
    pair = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # An idle program (a tile past the step's pairs) runs no block.
    for start in range(0, tl.where(active, half, 0), BLOCK_K // 2):
        byte_column = start + pair
        column_ok = byte_column < half
        x_mask = row_ok[:, None] & column_ok[None, :]
        even = tl.load(rows_ptr + 2 * byte_column[None, :], mask=x_mask, other=0.0)
        odd = tl.load(rows_ptr + 2 * byte_column[None, :] + 1, mask=x_mask, other=0.0)
        codes = tl.load(
            weight_ptr + output[:, None] * half + byte_column[None, :],
            mask=output_ok[:, None] & column_ok[None, :],
            other=0,
        ).to(tl.int32)
        codes = codes & 0xFF
        scale_bytes = tl.load(
            scale_ptr
            + output[:, None] * scale_columns
            + (byte_column // (SCALE_BLOCK // 2))[None, :],
            mask=output_ok[:, None] & column_ok[None, :],
            other=127,
        )
        scale = decode_e8m0(scale_bytes.to(tl.int32))
        low = decode_e2m1(codes & 15) * scale
        high = decode_e2m1(codes >> 4) * scale
        acc += tl.dot(even.to(tl.float32), tl.trans(low), input_precision="ieee")
        acc += tl.dot(odd.to(tl.float32), tl.trans(high), input_precision="ieee")
    return acc


@triton.jit
def _tile_rows(tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M: tl.constexpr):
    """This program's expert, its positions among the sorted pairs, which of them are the
    expert's, and whether it has any."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    position = start + tl.arange(0, BLOCK_M)
    end = tl.load(tile_end_ptr + tile)
    return expert, position, position < end, start < end


@triton.jit
def _gate_up_kernel(
    x_ptr,
    order_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    w1_table,
    w1_scale_table,
    w3_table,
    w3_scale_table,
    inner_ptr,
    hidden,
    intermediate,
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    expert, position, row_ok, active = _tile_rows(
        tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M
    )
    pair = tl.load(order_ptr + position, mask=row_ok, other=0)
    output = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    output_ok = output < intermediate
    rows_ptr = x_ptr + pair[:, None] * hidden
    gate = _packed_product(
        rows_ptr,
        row_ok,
        hidden,
        w1_table,
        w1_scale_table,
        expert,
        output,
        output_ok,
        active,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        SCALE_BLOCK,
    )
    up = _packed_product(
        rows_ptr,
        row_ok,
        hidden,
        w3_table,
        w3_scale_table,
        expert,
        output,
        output_ok,
        active,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        SCALE_BLOCK,
    )
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    inner = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        inner_ptr + position[:, None] * intermediate + output[None, :],
        inner,
        mask=row_ok[:, None] & output_ok[None, :],
    )


@triton.jit
def _down_kernel(
    inner_ptr,
    order_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    routing_ptr,
    w2_table,
    w2_scale_table,
    out_ptr,
    hidden,
    intermediate,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    expert, position, row_ok, active = _tile_rows(
        tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M
    )
    pair = tl.load(order_ptr + position, mask=row_ok, other=0)
    output = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    output_ok = output < hidden
    down = _packed_product(
        inner_ptr + position[:, None] * intermediate,
        row_ok,
        intermediate,
        w2_table,
        w2_scale_table,
        expert,
        output,
        output_ok,
        active,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        SCALE_BLOCK,
    )
    routing = tl.load(routing_ptr + pair, mask=row_ok, other=0.0)
    tl.store(
        out_ptr + pair[:, None] * hidden + output[None, :],
        down * routing[:, None],
        mask=row_ok[:, None] & output_ok[None, :],
    )


def mxfp4_expert_gemm(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    experts: MxFp4Experts,
    limit: float,
) -> torch.Tensor:
    """float32 [pairs, hidden]: row p = weights[p] * expert_{slots[p]}(x[p]) for x [pairs,
    hidden] float32 or bfloat16, slots int64 [pairs], weights float32 [pairs], pairs in any
    order (blockscaled.mxfp4_experts's contract). A slot outside the bank is not checked
    (that would synchronise with the host): its row stays zero."""
    _check_pairs(x, slots, weights, experts)
    pairs, hidden = x.shape
    intermediate = experts.intermediate_size
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    if not pairs:
        return out
    order, tiles = _row_tiles(slots, experts.num_experts)
    inner = torch.empty(pairs, intermediate, dtype=torch.float32, device=x.device)
    w1, w1_scale, w3, w3_scale, w2, w2_scale = (t.to(x.device) for t in experts.tables)
    num_tiles = tiles[0].shape[0]
    up_tile = tile_size(intermediate, OUT_TILE, MIN_DOT)
    _gate_up_kernel[(num_tiles, triton.cdiv(intermediate, up_tile))](
        x.contiguous(),
        order,
        *tiles,
        w1,
        w1_scale,
        w3,
        w3_scale,
        inner,
        hidden,
        intermediate,
        float(limit),
        BLOCK_M=ROW_TILE,
        BLOCK_N=up_tile,
        BLOCK_K=tile_size(hidden, IN_TILE, BLOCK),
        SCALE_BLOCK=BLOCK,
    )
    down_tile = tile_size(hidden, OUT_TILE, MIN_DOT)
    _down_kernel[(num_tiles, triton.cdiv(hidden, down_tile))](
        inner,
        order,
        *tiles,
        weights.contiguous(),
        w2,
        w2_scale,
        out,
        hidden,
        intermediate,
        BLOCK_M=ROW_TILE,
        BLOCK_N=down_tile,
        BLOCK_K=tile_size(intermediate, IN_TILE, BLOCK),
        SCALE_BLOCK=BLOCK,
    )
    return out


def _row_tiles(
    slots: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The pairs sorted by slot (`order`), and the row tiles over them: per tile its expert,
    its first sorted position and its expert's end. Built on the device for the most tiles
    the pairs can need (each busy expert's last tile may be partial); tiles past the ones
    needed are empty (start = end)."""
    sorted_slots, order = slots.sort(stable=True)
    ids = torch.arange(num_experts, device=slots.device)
    starts = torch.searchsorted(sorted_slots, ids)
    ends = torch.searchsorted(sorted_slots, ids, right=True)
    tiles_per_expert = (ends - starts + ROW_TILE - 1) // ROW_TILE
    tile_ends = tiles_per_expert.cumsum(0)
    most = triton.cdiv(slots.shape[0], ROW_TILE) + min(num_experts, slots.shape[0])
    tile = torch.arange(most, device=slots.device)
    expert = torch.searchsorted(tile_ends, tile, right=True).clamp(max=num_experts - 1)
    first_tile = tile_ends[expert] - tiles_per_expert[expert]
    start = starts[expert] + (tile - first_tile) * ROW_TILE
    end = torch.where(tile < tile_ends[-1], ends[expert], start)
    return order, (expert, start, end)
