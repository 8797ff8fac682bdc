"""The three V4.1 cache formats reproduce nemo's quantize_cache bit for bit (spec §3.7), and
their packed bytes (spec §4 sizes) unpack to exactly those values."""

from __future__ import annotations

import pytest
import torch
from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

from deepwell.engine.models.deepseek_v41.cache_formats import (
    fp8_row_bytes,
    mxfp4_row_bytes,
    nvfp4_row_bytes,
    pack_fp8,
    pack_mxfp4,
    pack_nvfp4,
    qdq_fp8,
    qdq_mxfp4,
    qdq_nvfp4,
    unpack_fp8,
    unpack_mxfp4,
    unpack_nvfp4,
)

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


CODECS = {
    "fp8": (qdq_fp8, pack_fp8, unpack_fp8, fp8_row_bytes),
    "nvfp4": (qdq_nvfp4, pack_nvfp4, unpack_nvfp4, nvfp4_row_bytes),
    "mxfp4": (qdq_mxfp4, pack_mxfp4, unpack_mxfp4, mxfp4_row_bytes),
}


def round_trip(fmt: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unpack(pack(x)), qdq(x in float32)), after checking the packed row's size."""
    qdq, pack, unpack, row_bytes = CODECS[fmt]
    packed = pack(x)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*x.shape[:-1], row_bytes(x.shape[-1]))
    return unpack(packed, x.shape[-1]), qdq(x.float())


def test_the_released_row_sizes() -> None:
    # spec §4: a window row, a compressed entry, an index key of the real config.
    assert (fp8_row_bytes(512), nvfp4_row_bytes(512), mxfp4_row_bytes(128)) == (528, 288, 68)


@pytest.mark.parametrize("fmt", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1e-2, 1.0, 6.0, 448.0, 3e4, 1e30])
def test_unpacking_the_bytes_gives_the_qdq_values_bit_for_bit(fmt, dtype, magnitude) -> None:
    generator = torch.Generator().manual_seed(int(magnitude * 1e3) % 1000 + 7)
    x = (torch.randn(3, 7, 128, generator=generator) * magnitude).to(dtype)
    x[0] *= torch.logspace(-3, 3, 128).to(dtype)
    x[1, :, ::17] *= 1000
    x[2, 0] = 0.0
    x[2, 1, :64] = -0.0
    unpacked, expected = round_trip(fmt, x)
    assert_same_bits(unpacked, expected)
    # In the input's dtype too: what a cache of rounded values in that dtype would hold.
    assert_same_bits(unpacked.to(dtype), CODECS[fmt][0](x))


@pytest.mark.parametrize("fmt", CODECS)
@pytest.mark.parametrize("channels", [1, 15, 17, 33, 40, 129])
def test_partial_groups_and_odd_channel_counts_round_trip(fmt: str, channels: int) -> None:
    x = torch.randn(4, channels, generator=torch.Generator().manual_seed(channels)) * 3
    assert_same_bits(*round_trip(fmt, x))


@pytest.mark.parametrize("fmt", CODECS)
def test_zero_groups_signed_zeros_and_tiny_values_round_trip(fmt: str) -> None:
    x = torch.zeros(4, 64)
    x[1] = -0.0
    x[2, :5] = torch.tensor([1e-38, -1e-40, 3e-45, 0.0, -0.0])
    x[3] = torch.linspace(-1e-5, 1e-5, 64)
    unpacked, expected = round_trip(fmt, x)
    assert_same_bits(unpacked, expected)
    assert bool(torch.signbit(unpacked[1]).all())


def test_the_byte_layout_is_codes_then_scales() -> None:
    # One group of 32 with maximum 6: mxfp4 scale 1 (UE8M0 127), codes in channel order, low
    # nibble first; fp8 scale 2^-6 (the ceiling of 6/448), code bytes then its UE8M0 byte.
    x = torch.zeros(32)
    x[:4] = torch.tensor([6.0, -0.5, 1.5, 0.0])
    assert pack_mxfp4(x).tolist() == [0x97, 0x03] + [0] * 14 + [127]
    fp8 = pack_fp8(x)
    assert fp8[-1].item() == 127 - 6
    assert fp8[:4].view(torch.float8_e4m3fn).float().tolist() == [384.0, -32.0, 96.0, 0.0]
    # nvfp4, groups of 16: maximum 6 gives the e4m3 scale 1 (0x38); the all-zero second
    # group the floor 2^-9 (0x01).
    assert pack_nvfp4(x).tolist() == [0x97, 0x03] + [0] * 14 + [0x38, 0x01]


def test_a_wrong_row_size_or_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="nvfp4 row of 512 channels is 288 uint8 bytes"):
        unpack_nvfp4(torch.zeros(4, 290, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="fp8 row"):
        unpack_fp8(torch.zeros(4, 528), 512)


def test_fp8_rounding_keeps_its_values_so_rounded_window_rows_pack_to_themselves() -> None:
    # The window ring stores rows already rounded (attention.write_window): a group whose
    # largest code rounds to 224 re-quantises with half the scale and the same values.
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(12))
    x[:32, 0] = torch.linspace(224.0, 239.0, 32)  # largest code rounds to 224 at scale 1
    x[32:] *= torch.logspace(-8, 8, 32)[:, None]
    rounded = qdq_fp8(x)
    assert_same_bits(unpack_fp8(pack_fp8(rounded), 128), rounded)


def test_nvfp4_rounding_is_not_idempotent_so_entries_pack_from_unrounded_values() -> None:
    # Maximum 9.5·2^-9: scale e4m3(max/6) = 2·2^-9 and the maximum rounds to the code 4, so
    # 8·2^-9; again, max/6 rounds to the scale 2^-9 and 8 clamps to the code 6.
    x = torch.zeros(16)
    x[0] = 9.5 * 2**-9
    once = qdq_nvfp4(x)
    assert once[0].item() == 8 * 2**-9
    assert qdq_nvfp4(once)[0].item() == 6 * 2**-9


@pytest.mark.parametrize("fmt", CODECS)
def test_unpacked_values_are_exact_in_bfloat16(fmt: str) -> None:
    # fp8/fp4 codes times power-of-two scales, and e2m1 (2 significant bits) times e4m3
    # scales (4 bits), need at most 6 of bfloat16's 8 significant bits, and bfloat16 has
    # float32's exponent range: a bfloat16 cache of the rounded values holds them exactly.
    generator = torch.Generator().manual_seed(13)
    x = torch.randn(64, 256, generator=generator) * torch.logspace(-30, 30, 64)[:, None]
    unpacked, _ = round_trip(fmt, x)
    assert torch.equal(unpacked.to(torch.bfloat16).float(), unpacked)
