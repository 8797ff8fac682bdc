"""The storage formats of DeepSeek-V4.1's released weights (spec §3.8), both directions.

Reading turns a stored tensor (and its `.scale`) into float32; writing, for tiny test
checkpoints, rounds float32 into the stored form. Every scale is F8_E8M0: a power of two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deepwell.engine.models.deepseek_v41.weight_layout import (
    SCALE_GROUP,
    WeightFormat,
    matrix_shape,
)

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
_E8M0_BIAS = 127
# E2M1 codes 0..15: bit 3 is the sign, bits 0-2 index the magnitudes.
_E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
# Byte b of a packed pair → (value of its low nibble, value of its high nibble).
_E2M1_PAIRS = torch.stack(
    (_E2M1_VALUES.repeat(16), _E2M1_VALUES.repeat_interleave(16)), dim=-1
).contiguous()
# Midpoints between neighbouring magnitudes, for rounding to the nearest code.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def dequantize(
    format: WeightFormat, weight: torch.Tensor, scale: torch.Tensor | None
) -> torch.Tensor:
    """A stored tensor (and its scale, for quantised formats) as float32 in its logical shape."""
    if not format.quantized:
        if scale is not None:
            raise ValueError(f"{format.value} tensors have no scale")
        return weight.to(torch.float32)
    if scale is None:
        raise ValueError(f"{format.value} tensors need their scale")
    if format is WeightFormat.MXFP4:
        return dequantize_mxfp4(weight, scale)
    return _dequantize_fp8(weight, scale, SCALE_GROUP if format is WeightFormat.FP8_BLOCKS else 1)


def quantize(format: WeightFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 → (stored tensor, scale or None): the inverse of `dequantize` up to rounding."""
    if format is WeightFormat.MXFP4:
        return quantize_mxfp4(x)
    if format is WeightFormat.FP8_BLOCKS:
        return quantize_fp8_blocks(x)
    if format is WeightFormat.FP8_ROWS:
        return quantize_fp8_rows(x)
    return x.to(format.stored_dtype), None


# --- E8M0 scales ---


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """F8_E8M0 (`torch.float8_e8m0fnu`) → float32: byte b is 2^(b-127), 255 is NaN."""
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"scales are float8_e8m0fnu (safetensors F8_E8M0), got {scale.dtype}")
    return scale.to(torch.float32)


def e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents e in [-127, 127] → the F8_E8M0 scales 2^e."""
    if exponent.numel() and (exponent.min() < -_E8M0_BIAS or exponent.max() > _E8M0_BIAS):
        raise ValueError("E8M0 exponents must lie in [-127, 127]")
    return (exponent + _E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _power_of_two_exponent(x: torch.Tensor) -> torch.Tensor:
    """The smallest e with 2^e >= x, for positive float32 x, exactly (no log2 rounding)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def _scale_exponents(groups_max: torch.Tensor, code_max: float) -> torch.Tensor:
    """Per group, the smallest power of two that brings its maximum within the code range.

    An all-zero group gets scale 1; exponents clamp to E8M0's range.
    """
    needed = torch.where(groups_max > 0, groups_max / code_max, torch.ones_like(groups_max))
    exponent = _power_of_two_exponent(needed.to(torch.float32))
    # The division above rounds; make sure max <= code_max * 2^e holds exactly.
    exponent = exponent + (groups_max > code_max * torch.exp2(exponent.float())).to(exponent.dtype)
    return exponent.clamp(-_E8M0_BIAS, _E8M0_BIAS)


# --- FP8 E4M3 with 32x32-block or row-wise scales ---


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """F8_E4M3 [rows, cols] with one E8M0 scale per 32x32 block → float32 [rows, cols]."""
    return _dequantize_fp8(weight, scale, SCALE_GROUP)


def dequantize_fp8_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """F8_E4M3 [rows, cols] with one E8M0 scale per row and 32 columns → float32."""
    return _dequantize_fp8(weight, scale, 1)


def quantize_fp8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [rows, cols] → (F8_E4M3 [rows, cols], E8M0 [ceil(rows/32), ceil(cols/32)])."""
    return _quantize_fp8(x, SCALE_GROUP)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [rows, cols] → (F8_E4M3 [rows, cols], E8M0 [rows, ceil(cols/32)])."""
    return _quantize_fp8(x, 1)


def _dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, row_block: int) -> torch.Tensor:
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weights are float8_e4m3fn (F8_E4M3), got {weight.dtype}")
    rows, cols = matrix_shape(tuple(weight.shape), "FP8 weight")
    _check_scale(scale, (math.ceil(rows / row_block), math.ceil(cols / SCALE_GROUP)))
    return _scaled(weight.to(torch.float32), e8m0_to_float(scale), row_block)


def _quantize_fp8(x: torch.Tensor, row_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = matrix_shape(tuple(x.shape), "FP8 input")
    blocks = _blocks(x.to(torch.float32), row_block)
    exponent = _scale_exponents(blocks.abs().amax(dim=(1, 3)), _E4M3_MAX)
    scaled = x.to(torch.float32) / _expand(torch.exp2(exponent.float()), rows, cols, row_block)
    return scaled.to(torch.float8_e4m3fn), e8m0_from_exponent(exponent)


# --- MXFP4: E2M1 pairs packed in bytes, an E8M0 scale per row and 32 columns ---


def dequantize_mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """I8 [rows, cols/2] (even column in the low nibble) with E8M0 [rows, ceil(cols/32)]
    → float32 [rows, cols]."""
    if weight.dtype != torch.int8:
        raise TypeError(f"MXFP4 weights are int8 (I8) pairs of E2M1 codes, got {weight.dtype}")
    rows, half = matrix_shape(tuple(weight.shape), "MXFP4 weight")
    cols = 2 * half
    _check_scale(scale, (rows, math.ceil(cols / SCALE_GROUP)))
    # One lookup per byte gives both of its values (low nibble first).
    values = _E2M1_PAIRS[weight.view(torch.uint8).to(torch.int32)].reshape(rows, cols)
    return _scaled(values, e8m0_to_float(scale), 1)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [rows, cols] (cols even) → (I8 [rows, cols/2], E8M0 [rows, ceil(cols/32)])."""
    rows, cols = matrix_shape(tuple(x.shape), "MXFP4 input")
    if cols % 2:
        raise ValueError(f"MXFP4 packs column pairs; {cols} columns is odd")
    x = x.to(torch.float32)
    exponent = _scale_exponents(_blocks(x, 1).abs().amax(dim=(1, 3)), _E2M1_MAX)
    scaled = x / _expand(torch.exp2(exponent.float()), rows, cols, 1)
    # Ties round towards the smaller magnitude; only the writer quantises, so any
    # nearest-value rule will do.
    magnitude = torch.bucketize(scaled.abs(), _E2M1_MIDPOINTS)
    negative = (scaled < 0) & (magnitude > 0)  # zero is always code 0, never -0
    codes = (magnitude | (negative.to(torch.int64) << 3)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), e8m0_from_exponent(exponent)


# --- shared shape handling ---


def _check_scale(scale: torch.Tensor, expected: tuple[int, int]) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale shape {list(scale.shape)} should be {list(expected)}")


def _blocks(x: torch.Tensor, row_block: int) -> torch.Tensor:
    """[rows, cols] zero-padded and viewed as [row blocks, row_block, col blocks, 32]."""
    rows, cols = x.shape
    padded = F.pad(x, (0, -cols % SCALE_GROUP, 0, -rows % row_block))
    return padded.view(padded.shape[0] // row_block, row_block, -1, SCALE_GROUP)


def _scaled(values: torch.Tensor, scale: torch.Tensor, row_block: int) -> torch.Tensor:
    """values [rows, cols] times their block's scale: broadcast over whole blocks where the
    shape allows (no [rows, cols] scale tensor), else through the expanded scales."""
    rows, cols = values.shape
    if rows % row_block or cols % SCALE_GROUP:
        return values * _expand(scale, rows, cols, row_block)
    blocks = values.view(rows // row_block, row_block, cols // SCALE_GROUP, SCALE_GROUP)
    return (blocks * scale[:, None, :, None]).view(rows, cols)


def _expand(scale: torch.Tensor, rows: int, cols: int, row_block: int) -> torch.Tensor:
    """Per-block scales [R, C] repeated to cover each element of [rows, cols]."""
    return scale.repeat_interleave(row_block, dim=0)[:rows].repeat_interleave(SCALE_GROUP, dim=1)[
        :, :cols
    ]
