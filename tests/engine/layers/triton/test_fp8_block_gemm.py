"""The Triton FP8-block GEMM against blockscaled's torch reference, through Triton's
interpreter; the E4M3 and E8M0 decodes over every byte."""

import pytest
import torch

from deepwell.engine.layers.blockscaled import fp8_block_linear_reference
from deepwell.engine.layers.triton.fp8_block_gemm import fp8_block_gemm
from deepwell.engine.models.deepseek_v41.weight_formats import quantize_fp8_blocks


def packed(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return quantize_fp8_blocks(torch.randn(out_features, in_features, generator=generator))


@pytest.mark.parametrize(
    "rows, out_features, in_features", [(1, 32, 64), (5, 70, 40), (17, 33, 96), (2, 40, 300)]
)
def test_matches_the_torch_reference(rows, out_features, in_features) -> None:
    weight, scale = packed(out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    expected = fp8_block_linear_reference(x, weight, scale)
    torch.testing.assert_close(fp8_block_gemm(x, weight, scale), expected, rtol=1e-5, atol=1e-5)


def test_every_weight_byte_and_scale_decodes_exactly() -> None:
    # One 32x32 block per scale byte 100..131 (2^-27 .. 2^4), its rows holding every E4M3
    # byte but the two NaNs; x = identity reads the dequantised weights back out.
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)]
    codes = torch.cat((codes, codes[:2])).view(32, 8).repeat(32, 4)
    weight = codes.view(torch.float8_e4m3fn).contiguous()
    scale = torch.arange(100, 132, dtype=torch.uint8).view(32, 1).view(torch.float8_e8m0fnu)
    x = torch.eye(32)
    expected = fp8_block_linear_reference(x, weight, scale)
    assert torch.equal(fp8_block_gemm(x, weight, scale), expected)


def test_the_smallest_scale_is_the_subnormal_two_to_minus_127() -> None:
    weight = torch.full((32, 32), 1.0).to(torch.float8_e4m3fn)
    scale = torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = fp8_block_gemm(torch.eye(32)[:1], weight, scale)
    assert torch.equal(out, torch.full((1, 32), 2.0**-127))


def test_bfloat16_inputs_give_the_reference() -> None:
    weight, scale = packed(64, 64)
    x = torch.randn(3, 64).bfloat16()
    expected = fp8_block_linear_reference(x, weight, scale)
    torch.testing.assert_close(fp8_block_gemm(x, weight, scale), expected, rtol=1e-5, atol=1e-5)


def test_a_wrong_scale_shape_is_refused_by_name() -> None:
    weight, scale = packed(64, 64)
    with pytest.raises(ValueError, match="scale must be"):
        fp8_block_gemm(torch.randn(2, 64), weight, scale[:1])
