"""Fp8BlockLinear: weights checked once when built, and the grouped projection through each
group's band of rows, the same bits as the product over that band alone."""

import pytest
import torch

from deepwell.engine.layers.blockscaled import fp8_block_linear
from deepwell.engine.models.deepseek_v41.packed_modules import Fp8BlockLinear


def fp8_weight(out_features: int, in_features: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 130, (-(-out_features // 32), -(-in_features // 32)))
    scale = exponents.to(torch.uint8).view(torch.float8_e8m0fnu)
    return weight, scale


def test_a_wrong_scale_is_refused_when_the_module_is_built() -> None:
    weight, _ = fp8_weight(64, 64)
    wrong = torch.zeros(1, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"scale must be float8_e8m0fnu \[2, 2\]"):
        Fp8BlockLinear([(weight, wrong)])


@pytest.mark.parametrize("out_features", [128, 96])  # bands of 32 rows, and of 24 (offsets)
def test_grouped_projection_is_each_bands_own_product(out_features: int) -> None:
    weight, scale = fp8_weight(out_features, 64)
    linear = Fp8BlockLinear([(weight, scale)])
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    band = out_features // 4
    expected = []
    for group in range(4):
        first, last = group * band // 32, -(-(group + 1) * band // 32)
        whole = fp8_block_linear(
            x[:, group].contiguous(), weight[first * 32 : last * 32], scale[first:last]
        )
        offset = group * band - first * 32
        expected.append(whole[:, offset : offset + band])
    got = linear.grouped(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.stack(expected, dim=1).to(torch.bfloat16))


def test_grouped_projection_reads_the_buffers_after_they_move() -> None:
    weight, scale = fp8_weight(128, 64)
    linear = Fp8BlockLinear([(weight, scale)])
    x = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    before = linear.grouped(x)
    # As .to(device) does: every buffer replaced by a new tensor.
    linear._apply(lambda tensor: tensor.clone())
    linear.weight0.view(torch.uint8).zero_()
    assert torch.equal(linear.grouped(x), torch.zeros_like(before))
