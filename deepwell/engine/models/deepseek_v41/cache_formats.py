"""DeepSeek-V4.1's three cache formats (spec §3.7): quantise-dequantise, and the released
bytes of a row (pack, unpack) that hold exactly those values.

The model was trained with its caches rounded this way; nemo's `quantize_cache` is the
bit-exact reference for the `qdq_*` functions, and `unpack_*(pack_*(x))` gives the float32
values `qdq_*(x.float())` gives, bit for bit, since both decode the same codes and scales.

A packed row of C channels is its codes, then its scales (spec §4 sizes, C = 512 / 128):
- fp8 (window KV): C e4m3 bytes, then ceil(C/32) UE8M0 bytes: 512 + 16 = 528 B;
- nvfp4 (compressed KV): ceil(C/2) e2m1 bytes, then ceil(C/16) e4m3 bytes: 256 + 32 = 288 B;
- mxfp4 (index keys): ceil(C/2) e2m1 bytes, then ceil(C/32) UE8M0 bytes: 64 + 4 = 68 B.
Two e2m1 codes share a byte, channel 2i in the low nibble; a code is its sign bit (8) plus
the index of its magnitude in (0, .5, 1, 1.5, 2, 3, 4, 6). A UE8M0 byte e is the scale
2^(e - 127), the scale's float32 exponent field. A partial last group's missing channels
quantise as zeros and are not stored (an odd C's last high nibble is 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepwell.engine.models.deepseek_v41.cache_rows import (
    FP8_GROUP,
    MXFP4_GROUP,
    NVFP4_GROUP,
    fp8_row_bytes,
    mxfp4_row_bytes,
    nvfp4_row_bytes,
)

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
# e2m1 code → value: the magnitudes, then the same with the sign bit set.
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]).repeat(2)
_E2M1_VALUES[8:] *= -1
# Twice an e2m1 magnitude (0, 1, 2, 3, 4, 6, 8, 12) → its code.
_E2M1_CODE_OF_DOUBLE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def qdq_fp8(x: torch.Tensor) -> torch.Tensor:
    """Window KV: fp8 e4m3 with a power-of-two scale per 32 channels of the last dim."""
    codes, scale, channels = _fp8_parts(x)
    return _ungrouped(codes.float() * scale, channels, x.dtype)


def qdq_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """Compressed KV: fp4 e2m1 with an e4m3 scale per 16 channels of the last dim."""
    values, scale, channels = _nvfp4_parts(x)
    return _ungrouped(values * scale.float(), channels, x.dtype)


def qdq_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """Index keys and queries: fp4 e2m1 with a UE8M0 (power-of-two) scale per 32 channels."""
    values, scale, channels = _mxfp4_parts(x)
    return _ungrouped(values * scale, channels, x.dtype)


def pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] → uint8 [..., fp8_row_bytes(C)]."""
    codes, scale, channels = _fp8_parts(x)
    code_bytes = codes.view(torch.uint8).flatten(-2)[..., :channels]
    return torch.cat((code_bytes, _ue8m0_bytes(scale)), dim=-1)


def unpack_fp8(packed: torch.Tensor, channels: int) -> torch.Tensor:
    """uint8 [..., fp8_row_bytes(C)] → float32 [..., C]."""
    _check_row(packed, fp8_row_bytes(channels), "fp8", channels)
    groups = _groups(channels, FP8_GROUP)
    codes = _padded(packed[..., :channels], groups * FP8_GROUP)
    codes = codes.view(torch.float8_e4m3fn).unflatten(-1, (groups, FP8_GROUP)).float()
    return _ungrouped(codes * _ue8m0_scales(packed[..., channels:]), channels, torch.float32)


def pack_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] → uint8 [..., nvfp4_row_bytes(C)]."""
    values, scale, channels = _nvfp4_parts(x)
    return torch.cat((_e2m1_bytes(values, channels), scale.view(torch.uint8).flatten(-2)), -1)


def unpack_nvfp4(packed: torch.Tensor, channels: int) -> torch.Tensor:
    """uint8 [..., nvfp4_row_bytes(C)] → float32 [..., C]."""
    _check_row(packed, nvfp4_row_bytes(channels), "nvfp4", channels)
    code_bytes = _groups(channels, 2)
    values = _e2m1_values(packed[..., :code_bytes], channels, NVFP4_GROUP)
    scale = packed[..., code_bytes:].view(torch.float8_e4m3fn).float().unsqueeze(-1)
    return _ungrouped(values * scale, channels, torch.float32)


def pack_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] → uint8 [..., mxfp4_row_bytes(C)]."""
    values, scale, channels = _mxfp4_parts(x)
    return torch.cat((_e2m1_bytes(values, channels), _ue8m0_bytes(scale)), dim=-1)


def unpack_mxfp4(packed: torch.Tensor, channels: int) -> torch.Tensor:
    """uint8 [..., mxfp4_row_bytes(C)] → float32 [..., C]."""
    _check_row(packed, mxfp4_row_bytes(channels), "mxfp4", channels)
    code_bytes = _groups(channels, 2)
    values = _e2m1_values(packed[..., :code_bytes], channels, MXFP4_GROUP)
    return _ungrouped(values * _ue8m0_scales(packed[..., code_bytes:]), channels, torch.float32)


def _fp8_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """e4m3 codes [..., groups, 32] and float32 power-of-two scales [..., groups, 1]."""
    groups, channels = _grouped(x, FP8_GROUP)
    # 1e-4 floors an all-zero group's scale. The scale is rounded up, so codes never clamp.
    scale = _power_of_two_ceiling(_group_max(groups).clamp_min(1e-4) * (1 / _E4M3_MAX))
    codes = (groups / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale, channels


def _nvfp4_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """e2m1 values (float32) [..., groups, 16] and e4m3 scales [..., groups, 1]."""
    groups, channels = _grouped(x, NVFP4_GROUP)
    # The scale is max/6 rounded to nearest e4m3 (2^-9, its smallest subnormal, at least),
    # so it can land below max/6 and the largest values then clamp at 6.
    scale = (_group_max(groups).clamp_min(_E2M1_MAX * 2**-9) / _E2M1_MAX).to(torch.float8_e4m3fn)
    return _round_e2m1(groups / scale.float()), scale, channels


def _mxfp4_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """e2m1 values (float32) [..., groups, 32] and float32 power-of-two scales [..., groups, 1]."""
    groups, channels = _grouped(x, MXFP4_GROUP)
    scale = _power_of_two_ceiling(
        _group_max(groups).clamp_min(_E2M1_MAX * 2**-126) * (1 / _E2M1_MAX)
    )
    return _round_e2m1(groups / scale), scale, channels


def _groups(channels: int, group: int) -> int:
    return -(-channels // group)


def _grouped(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """[..., C] as fp32 [..., ceil(C/group), group]; a partial last group is zero-filled."""
    channels = x.shape[-1]
    padded = F.pad(x.float(), (0, -channels % group))
    return padded.unflatten(-1, (-1, group)), channels


def _ungrouped(groups: torch.Tensor, channels: int, dtype: torch.dtype) -> torch.Tensor:
    flat = groups.flatten(-2)
    return (flat if flat.shape[-1] == channels else flat[..., :channels]).to(dtype)


def _group_max(groups: torch.Tensor) -> torch.Tensor:
    return groups.abs().amax(-1, keepdim=True)


def _power_of_two_ceiling(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x, for positive fp32, from the IEEE bits (no log2 rounding)."""
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    inexact = ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((exponent + inexact) << 23).view(torch.float32)


def _ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales [..., groups, 1] → their exponent fields [..., groups]."""
    return (scale.flatten(-2).contiguous().view(torch.int32) >> 23).to(torch.uint8)


def _ue8m0_scales(exponents: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes [..., groups] → float32 scales [..., groups, 1] (the formats' scales are at
    least 2^-126, so the exponent field is never the subnormal 0)."""
    return (exponents.to(torch.int32) << 23).view(torch.float32).unsqueeze(-1)


def _e2m1_bytes(values: torch.Tensor, channels: int) -> torch.Tensor:
    """e2m1 values [..., groups, group] (float32) → two codes a byte [..., ceil(C/2)]."""
    values = values.flatten(-2)[..., : 2 * _groups(channels, 2)]
    # A NaN input (never a real cache value) must still index the table.
    doubled = (values.abs() * 2).nan_to_num(0.0).to(torch.long)
    codes = _E2M1_CODE_OF_DOUBLE[doubled] | (torch.signbit(values).to(torch.uint8) << 3)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _e2m1_values(code_bytes: torch.Tensor, channels: int, group: int) -> torch.Tensor:
    """Two codes a byte [..., ceil(C/2)] → e2m1 values [..., groups, group] (float32)."""
    codes = torch.stack((code_bytes & 0xF, code_bytes >> 4), dim=-1).flatten(-2)
    codes = _padded(codes, _groups(channels, group) * group)
    return _E2M1_VALUES[codes.to(torch.long)].unflatten(-1, (-1, group))


def _padded(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Codes [..., n] zero-filled to [..., width] (a partial last group)."""
    if codes.shape[-1] == width:
        return codes
    return F.pad(codes, (0, width - codes.shape[-1]))


def _check_row(packed: torch.Tensor, row_bytes: int, name: str, channels: int) -> None:
    if packed.dtype != torch.uint8 or packed.shape[-1] != row_bytes:
        raise ValueError(
            f"a packed {name} row of {channels} channels is {row_bytes} uint8 bytes; got "
            f"{packed.dtype} rows of {packed.shape[-1]}"
        )


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6), saturating, ties to even.

    Within each binade the e2m1 values are evenly spaced (0.5 below 2, 1 below 4, then 2),
    and an even multiple of the spacing is an even code, so round-half-even on x/spacing
    is the format's own tie rule.
    """
    magnitude = x.abs().clamp_max(_E2M1_MAX)
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / spacing) * spacing, x)
