"""V4.1's rotary embedding: the native rotation (layers/v41_rotary.cpp) gives the torch ops'
bits, forward and inverse, for bfloat16 and float32 values with and without middle axes."""

import pytest
import torch

from deepwell.engine.models.deepseek_v41.rotary import PairRotary, native_rotation

pytestmark = pytest.mark.skipif(not native_rotation(), reason="the rotary kernel did not build")

SCALING = {
    "original_max_position_embeddings": 64,
    "factor": 16.0,
    "beta_fast": 32,
    "beta_slow": 1,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 128), (3, 16, 128), (2, 3, 4, 64), (4, 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_native_rotation_gives_the_torch_ops_bits(dtype, shape, inverse) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    rotary = PairRotary(64, 160000.0, SCALING)
    values = (torch.randn(shape, generator=generator) * 8).to(dtype)
    rotation = rotary.rotation(torch.randint(0, 5000, (shape[0],), generator=generator))
    got = rotary.apply(values, rotation, inverse=inverse)
    expected = rotary.apply_torch(values, rotation, inverse=inverse)
    assert got.dtype == dtype and got.shape == values.shape
    assert torch.equal(got, expected)


def test_native_rotation_reads_strided_values_and_a_conjugate_view() -> None:
    rotary = PairRotary(64, 10000.0, None)
    values = torch.randn(6, 128, dtype=torch.bfloat16)[::2]
    rotation = rotary.rotation(torch.tensor([3, 9, 27]))
    assert torch.equal(
        rotary.apply(values, rotation.conj()), rotary.apply_torch(values, rotation, inverse=True)
    )


def test_a_rotation_of_the_wrong_shape_is_an_error() -> None:
    rotary = PairRotary(64, 10000.0, None)
    rotation = rotary.rotation(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match=r"rotation must be complex64 \[3, 32\]"):
        rotary.apply(torch.randn(3, 128), rotation)
