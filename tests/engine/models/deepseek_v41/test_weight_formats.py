"""The released weight formats: E8M0 scales, FP8 blocks and rows, MXFP4; nemo reads the same."""

import pytest
import torch
from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import (
    dequantize_checkpoint_weight,
)

from deepwell.engine.models.deepseek_v41.weight_formats import (
    WeightFormat,
    dequantize,
    dequantize_mxfp4,
    e8m0_from_exponent,
    e8m0_to_float,
    quantize,
)

QUANTIZED = [WeightFormat.FP8_BLOCKS, WeightFormat.FP8_ROWS, WeightFormat.MXFP4]
# Shapes with and without whole 32-blocks (MXFP4 needs an even column count).
SHAPES = [(64, 96), (70, 46), (1, 32), (33, 2)]


def random_matrix(shape, seed=0, spread=4.0) -> torch.Tensor:
    """Values over several binades, so blocks get different scales."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(spread * (torch.rand(shape, generator=generator) - 0.5))
    return torch.randn(shape, generator=generator) * magnitude


def block_scale(format: WeightFormat, scale: torch.Tensor, shape) -> torch.Tensor:
    """Each element's scale, float32."""
    rows, cols = shape
    row_block = 32 if format is WeightFormat.FP8_BLOCKS else 1
    scale = e8m0_to_float(scale).repeat_interleave(row_block, 0)[:rows]
    return scale.repeat_interleave(32, 1)[:, :cols]


def error_bound(format: WeightFormat, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Half a step of the format at each value: FP8 E4M3 has 3 mantissa bits (subnormal
    step 2^-9 of the scale); E2M1's steps are 0.5 below 2, 1 below 4, then 2."""
    s = block_scale(format, scale, x.shape)
    if format is WeightFormat.MXFP4:
        return x.abs() / 4 + s / 4
    return x.abs() / 16 + s * 2**-10


def test_e8m0_byte_b_is_two_to_the_b_minus_127() -> None:
    codes = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(e8m0_to_float(codes), torch.exp2(torch.arange(255.0) - 127))
    exponents = torch.tensor([-127, -3, 0, 5, 127])
    assert torch.equal(e8m0_from_exponent(exponents).view(torch.uint8), (exponents + 127).byte())
    with pytest.raises(ValueError):
        e8m0_from_exponent(torch.tensor([128]))


def test_scales_must_be_e8m0() -> None:
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        e8m0_to_float(torch.ones(2, 2))


@pytest.mark.parametrize("format", QUANTIZED)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_round_trip_is_within_half_a_step(format, shape) -> None:
    x = random_matrix(shape)
    weight, scale = quantize(format, x)
    assert weight.dtype == format.stored_dtype and tuple(weight.shape) == format.stored_shape(shape)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == format.scale_shape(shape)
    restored = dequantize(format, weight, scale)
    assert restored.dtype == torch.float32 and restored.shape == x.shape
    assert ((restored - x).abs() <= error_bound(format, x, scale)).all()
    # Stored values are representable: quantising them again changes nothing.
    assert torch.equal(dequantize(format, *quantize(format, restored)), restored)


def test_scale_shapes_follow_the_release() -> None:
    assert WeightFormat.FP8_BLOCKS.scale_shape((5120, 1280)) == (160, 40)
    assert WeightFormat.FP8_BLOCKS.scale_shape((33, 65)) == (2, 3)
    assert WeightFormat.MXFP4.stored_shape((2304, 5120)) == (2304, 2560)
    assert WeightFormat.MXFP4.scale_shape((2304, 5120)) == (2304, 160)
    assert WeightFormat.FP8_ROWS.scale_shape((1000, 256)) == (1000, 8)
    assert WeightFormat.BF16.scale_shape((4, 4)) is None


def test_mxfp4_keeps_the_even_column_in_the_low_nibble_and_the_sign_in_bit_3() -> None:
    # low nibble 0x1 = +0.5 (column 0), high nibble 0xA = -1.0 (column 1)
    packed = torch.tensor([[0xA1 - 256]], dtype=torch.int8)
    scale = e8m0_from_exponent(torch.tensor([[1]]))  # x2
    assert dequantize_mxfp4(packed, scale).tolist() == [[1.0, -2.0]]
    codes = torch.arange(16, dtype=torch.uint8)
    every_code = (codes | (codes << 4)).view(torch.int8).view(1, 16)
    decoded = dequantize_mxfp4(every_code, e8m0_from_exponent(torch.zeros(1, 1, dtype=torch.long)))
    magnitudes = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert decoded[0, 0::2].tolist() == magnitudes + [-m for m in magnitudes]


def test_an_all_zero_block_stores_zeros() -> None:
    for format in QUANTIZED:
        weight, scale = quantize(format, torch.zeros(32, 64))
        assert not dequantize(format, weight, scale).any()


def test_wrong_scale_shape_or_dtype_is_refused() -> None:
    weight, scale = quantize(WeightFormat.FP8_BLOCKS, random_matrix((64, 64)))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(WeightFormat.FP8_BLOCKS, weight, scale[:1])
    with pytest.raises(TypeError, match="int8"):
        dequantize(WeightFormat.MXFP4, weight, scale)
    with pytest.raises(ValueError, match="need their scale"):
        dequantize(WeightFormat.FP8_ROWS, weight, None)


def random_stored(format: WeightFormat, shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary stored bytes: every code, scales over a wide exponent range."""
    generator = torch.Generator().manual_seed(seed)
    stored_shape = format.stored_shape(shape)
    raw = torch.randint(0, 256, stored_shape, generator=generator, dtype=torch.uint8)
    if format is WeightFormat.MXFP4:
        weight = raw.view(torch.int8)
    else:
        raw[(raw & 0x7F) == 0x7F] = 0  # E4M3's NaN codes
        weight = raw.view(torch.float8_e4m3fn)
    exponents = torch.randint(-40, 40, format.scale_shape(shape), generator=generator)
    return weight, e8m0_from_exponent(exponents)


@pytest.mark.parametrize("format", QUANTIZED)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantization_matches_nemo_on_random_stored_bytes(format, shape) -> None:
    weight, scale = random_stored(format, shape, seed=shape[0] * 100 + shape[1] + len(format.value))
    reference = dequantize_checkpoint_weight(
        weight, scale, dtype=torch.float32, rowwise=format is WeightFormat.FP8_ROWS
    )
    assert torch.equal(dequantize(format, weight, scale), reference)


@pytest.mark.parametrize("format", QUANTIZED)
def test_nemo_reads_what_our_quantiser_writes(format) -> None:
    x = random_matrix((96, 64), seed=3)
    weight, scale = quantize(format, x)
    reference = dequantize_checkpoint_weight(
        weight, scale, dtype=torch.float32, rowwise=format is WeightFormat.FP8_ROWS
    )
    assert torch.equal(reference, dequantize(format, weight, scale))
