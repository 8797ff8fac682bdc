"""The FP8-block GEMM in Triton: x [rows, in] · W.T for an FP8 E4M3 W [out, in] with an E8M0
scale per 32x32 block, float32 out.

The Triton counterpart of layers/blockscaled.py's `fp8_block_linear`, same interface. A
program owns a tile of rows and of outputs and walks the inputs a tile of whole 32-wide
scale blocks at a time: it decodes the weight bytes and their blocks' scales
(triton/encodings.py, exact) and multiplies in float32 at IEEE precision, so it matches the
reference up to summation order.
"""

import torch
import triton
import triton.language as tl

from deepwell.engine.layers.blockscaled import BLOCK, _check_fp8
from deepwell.engine.layers.triton.encodings import decode_e4m3, decode_e8m0

# Largest tiles (rows, outputs, inputs); smaller where the matrix is (at least 16 for
# tl.dot, the inputs' a whole number of scale blocks).
ROW_TILE = 64
OUT_TILE = 64
IN_TILE = 128
MIN_DOT = 16


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    weight_ptr,
    scale_ptr,
    out_ptr,
    rows,
    out_features,
    in_features,
    scale_columns,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    output = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = row < rows
    output_ok = output < out_features
    row = row.to(tl.int64)
    output = output.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, in_features, BLOCK_K):
        column = start + tl.arange(0, BLOCK_K)
        column_ok = column < in_features
        x = tl.load(
            x_ptr + row[:, None] * in_features + column[None, :],
            mask=row_ok[:, None] & column_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        codes = tl.load(
            weight_ptr + output[:, None] * in_features + column[None, :],
            mask=output_ok[:, None] & column_ok[None, :],
            other=0,
        ).to(tl.int32)
        scale_bytes = tl.load(
            scale_ptr
            + (output // SCALE_BLOCK)[:, None] * scale_columns
            + (column // SCALE_BLOCK)[None, :],
            mask=output_ok[:, None] & column_ok[None, :],
            other=127,
        ).to(tl.int32)
        weight = decode_e4m3(codes) * decode_e8m0(scale_bytes)
        acc += tl.dot(x, tl.trans(weight), input_precision="ieee")
    tl.store(
        out_ptr + row[:, None] * out_features + output[None, :],
        acc,
        mask=row_ok[:, None] & output_ok[None, :],
    )


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [rows, out] ≈ x.float() @ dequantize_fp8_blocks(weight, scale).T for x
    [rows, in] float32 or bfloat16, weight float8_e4m3fn [out, in], scale float8_e8m0fnu
    [ceil(out / 32), ceil(in / 32)] (blockscaled.fp8_block_linear's contract)."""
    _check_fp8(x, weight, scale)
    rows = x.shape[0]
    out_features, in_features = weight.shape
    out = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
    if rows and out_features:
        tiles = dict(
            BLOCK_M=tile_size(rows, ROW_TILE, MIN_DOT),
            BLOCK_N=tile_size(out_features, OUT_TILE, MIN_DOT),
            BLOCK_K=tile_size(in_features, IN_TILE, BLOCK),
            SCALE_BLOCK=BLOCK,
        )
        grid = (triton.cdiv(rows, tiles["BLOCK_M"]), triton.cdiv(out_features, tiles["BLOCK_N"]))
        _fp8_block_gemm_kernel[grid](
            x.contiguous(),
            weight.contiguous().view(torch.uint8),
            scale.contiguous().view(torch.uint8),
            out,
            rows,
            out_features,
            in_features,
            scale.shape[1],
            **tiles,
        )
    return out


def tile_size(size: int, largest: int, smallest: int) -> int:
    """A power-of-two tile for `size`: its next power of two within [smallest, largest]."""
    return max(smallest, min(largest, triton.next_power_of_2(size)))
