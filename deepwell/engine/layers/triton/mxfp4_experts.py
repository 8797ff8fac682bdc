"""The grouped MXFP4 expert GEMM in Triton: one MoE layer's routed experts over all of a
step's (token, expert) pairs, W2(silu(min(W1 x, limit)) · clamp(W3 x, ±limit)) · weight.

The Triton counterpart of layers/blockscaled.py's `mxfp4_experts`, same interface. Pairs are
sorted by expert on the device (no host synchronisation); two kernels then run a grid of
(expert, row tile, output tile) programs, each finding its expert's pairs from the sorted
slots and its weights through `MxFp4Experts`'s address tables (a `tl.pointer_type` cast, so
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

ROW_TILE = 16
OUT_TILE = 32


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
):
    """[BLOCK_M, BLOCK_N] float32: rows [BLOCK_M, in_features] (pointers to their first
    input) times the rows `output` of expert `expert`'s MXFP4 matrix, transposed."""
    weight_ptr = tl.load(table_ptr + expert).to(tl.pointer_type(tl.uint8))
    scale_ptr = tl.load(scale_table_ptr + expert).to(tl.pointer_type(tl.uint8))
    half = in_features // 2
    scale_columns = tl.cdiv(in_features, BLOCK_K)
    pair = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # An idle program (past its expert's pairs) runs no block.
    blocks = tl.where(active, scale_columns, 0)
    for block in range(0, blocks):
        byte_column = block * (BLOCK_K // 2) + pair
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
        scale_bytes = tl.load(scale_ptr + output * scale_columns + block, mask=output_ok, other=127)
        scale = decode_e8m0(scale_bytes.to(tl.int32))[:, None]
        low = decode_e2m1(codes & 15) * scale
        high = decode_e2m1(codes >> 4) * scale
        acc += tl.dot(even.to(tl.float32), tl.trans(low), input_precision="ieee")
        acc += tl.dot(odd.to(tl.float32), tl.trans(high), input_precision="ieee")
    return acc


@triton.jit
def _expert_rows(starts_ptr, ends_ptr, expert, BLOCK_M: tl.constexpr):
    """This program's positions among the sorted pairs, which of them are its expert's, and
    whether it has any."""
    start = tl.load(starts_ptr + expert)
    end = tl.load(ends_ptr + expert)
    position = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = position < end
    return position, row_ok, start + tl.program_id(1) * BLOCK_M < end


@triton.jit
def _gate_up_kernel(
    x_ptr,
    order_ptr,
    starts_ptr,
    ends_ptr,
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
):
    expert = tl.program_id(0)
    position, row_ok, active = _expert_rows(starts_ptr, ends_ptr, expert, BLOCK_M)
    pair = tl.load(order_ptr + position, mask=row_ok, other=0)
    output = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
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
    starts_ptr,
    ends_ptr,
    routing_ptr,
    w2_table,
    w2_scale_table,
    out_ptr,
    hidden,
    intermediate,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.program_id(0)
    position, row_ok, active = _expert_rows(starts_ptr, ends_ptr, expert, BLOCK_M)
    pair = tl.load(order_ptr + position, mask=row_ok, other=0)
    output = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
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
    sorted_slots, order = slots.sort(stable=True)
    ids = torch.arange(experts.num_experts, device=slots.device)
    starts = torch.searchsorted(sorted_slots, ids)
    ends = torch.searchsorted(sorted_slots, ids, right=True)
    inner = torch.empty(pairs, intermediate, dtype=torch.float32, device=x.device)
    w1, w1_scale, w3, w3_scale, w2, w2_scale = (t.to(x.device) for t in experts.tables)
    row_tiles = triton.cdiv(pairs, ROW_TILE)
    tiles = dict(BLOCK_M=ROW_TILE, BLOCK_N=OUT_TILE, BLOCK_K=BLOCK)
    _gate_up_kernel[(experts.num_experts, row_tiles, triton.cdiv(intermediate, OUT_TILE))](
        x.contiguous(),
        order,
        starts,
        ends,
        w1,
        w1_scale,
        w3,
        w3_scale,
        inner,
        hidden,
        intermediate,
        float(limit),
        **tiles,
    )
    _down_kernel[(experts.num_experts, row_tiles, triton.cdiv(hidden, OUT_TILE))](
        inner,
        order,
        starts,
        ends,
        weights.contiguous(),
        w2,
        w2_scale,
        out,
        hidden,
        intermediate,
        **tiles,
    )
    return out
