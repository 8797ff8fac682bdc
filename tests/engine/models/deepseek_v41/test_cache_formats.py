"""The three V4.1 cache formats reproduce nemo's quantize_cache bit for bit (spec §3.7)."""

from __future__ import annotations

import pytest
import torch
from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

from deepwell.engine.models.deepseek_v41.cache_formats import qdq_fp8, qdq_mxfp4, qdq_nvfp4

FORMATS = {
    "fp8": (qdq_fp8, 32),
    "nvfp4": (qdq_nvfp4, 16),
    "mxfp4": (qdq_mxfp4, 32),
}


def reference(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return quantize_cache(x, format=fmt, block_size=FORMATS[fmt][1])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    # Bitwise: -0.0 and 0.0 count as different here.
    as_int = torch.int32 if actual.dtype == torch.float32 else torch.int16
    assert torch.equal(actual.view(as_int), expected.view(as_int))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1e-2, 1.0, 6.0, 448.0, 3e4, 1e30])
def test_random_values_match_nemo(fmt: str, dtype: torch.dtype, magnitude: float) -> None:
    generator = torch.Generator().manual_seed(int(magnitude * 1e3) % 1000)
    x = (torch.randn(3, 7, 128, generator=generator) * magnitude).to(dtype)
    # Groups whose amax spans many binades, and heavy-tailed outliers.
    x[0] *= torch.logspace(-3, 3, 128).to(dtype)
    x[1, :, ::17] *= 1000
    assert_same_bits(FORMATS[fmt][0](x), reference(x, fmt))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_ties_round_to_the_even_code(fmt: str) -> None:
    # Group maximum 6 gives scale 1 in both fp4 formats, so these are exact midpoints.
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 4.5, 5.5, 0.74]
    x = torch.tensor(ties + [0.0] * (32 - len(ties)))
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -4.0, 4.0, 6.0, 0.5]
    got = FORMATS[fmt][0](x)
    assert got[: len(ties)].tolist() == expected
    assert_same_bits(got, reference(x, fmt))


def test_fp8_ties_round_to_the_even_mantissa() -> None:
    # Group maximum 448 gives scale 1; e4m3 spacing is 1/8 in [1, 2), 16 in [128, 256).
    x = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 232.0, 248.0] + [0.0] * 26)
    got = qdq_fp8(x)
    assert got[:6].tolist() == [448.0, 1.0, 1.25, -1.0, 224.0, 256.0]
    assert_same_bits(got, reference(x, "fp8"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_groups_signed_zeros_and_tiny_values_match_nemo(fmt: str) -> None:
    x = torch.zeros(4, 64)
    x[1] = -0.0
    x[2, :5] = torch.tensor([1e-38, -1e-40, 3e-45, 0.0, -0.0])
    x[3] = torch.linspace(-1e-5, 1e-5, 64)
    got = FORMATS[fmt][0](x)
    assert_same_bits(got, reference(x, fmt))
    assert bool((got[0] == 0).all()) and bool(torch.signbit(got[1]).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_partial_last_group_is_quantised_as_if_zero_padded(fmt: str) -> None:
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    assert_same_bits(FORMATS[fmt][0](x), reference(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_input_is_left_untouched(fmt: str) -> None:
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    before = x.clone()
    out = FORMATS[fmt][0](x)
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
