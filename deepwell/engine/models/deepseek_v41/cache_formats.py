"""Quantise-dequantise through DeepSeek-V4.1's three cache formats (spec §3.7).

The model was trained with its caches rounded this way, so an engine that keeps them in a
wider dtype rounds them identically; nemo's `quantize_cache` is the bit-exact reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_GROUP = 32
NVFP4_GROUP = 16
MXFP4_GROUP = 32

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


def qdq_fp8(x: torch.Tensor) -> torch.Tensor:
    """Window KV: fp8 e4m3 with a power-of-two scale per 32 channels of the last dim."""
    groups, channels = _grouped(x, FP8_GROUP)
    # 1e-4 floors an all-zero group's scale. The scale is rounded up, so codes never clamp.
    scale = _power_of_two_ceiling(_group_max(groups).clamp_min(1e-4) * (1 / _E4M3_MAX))
    codes = (groups / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return _ungrouped(codes.float() * scale, channels, x.dtype)


def qdq_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """Compressed KV: fp4 e2m1 with an e4m3 scale per 16 channels of the last dim."""
    groups, channels = _grouped(x, NVFP4_GROUP)
    # The scale is max/6 rounded to nearest e4m3 (2^-9, its smallest subnormal, at least),
    # so it can land below max/6 and the largest values then clamp at 6.
    scale = (_group_max(groups).clamp_min(_E2M1_MAX * 2**-9) / _E2M1_MAX).to(torch.float8_e4m3fn)
    return _ungrouped(_round_e2m1(groups / scale.float()) * scale.float(), channels, x.dtype)


def qdq_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """Index keys and queries: fp4 e2m1 with a UE8M0 (power-of-two) scale per 32 channels."""
    groups, channels = _grouped(x, MXFP4_GROUP)
    scale = _power_of_two_ceiling(
        _group_max(groups).clamp_min(_E2M1_MAX * 2**-126) * (1 / _E2M1_MAX)
    )
    return _ungrouped(_round_e2m1(groups / scale) * scale, channels, x.dtype)


def _grouped(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """[..., C] as fp32 [..., ceil(C/group), group]; a partial last group is zero-filled."""
    channels = x.shape[-1]
    padded = F.pad(x.float(), (0, -channels % group))
    return padded.unflatten(-1, (-1, group)), channels


def _ungrouped(groups: torch.Tensor, channels: int, dtype: torch.dtype) -> torch.Tensor:
    return groups.flatten(-2)[..., :channels].to(dtype)


def _group_max(groups: torch.Tensor) -> torch.Tensor:
    return groups.abs().amax(-1, keepdim=True)


def _power_of_two_ceiling(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x, for positive fp32, from the IEEE bits (no log2 rounding)."""
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    inexact = ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((exponent + inexact) << 23).view(torch.float32)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6), saturating, ties to even.

    Within each binade the e2m1 values are evenly spaced (0.5 below 2, 1 below 4, then 2),
    and an even multiple of the spacing is an even code, so round-half-even on x/spacing
    is the format's own tie rule.
    """
    magnitude = x.abs().clamp_max(_E2M1_MAX)
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / spacing) * spacing, x)
