"""Products with weights kept in their block-scaled storage formats (DeepSeek-V4.1, spec §3.8).

Pure-torch reference implementations: each dequantises a bounded slice of the weight (a band
of output rows, one expert) to float32 and multiplies it, so a big matrix is never expanded
whole. Rows go through the products in fixed ROW_TILE tiles, zero-padded: an output row
depends on its own input row only, whatever else the call holds (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from deepwell.engine.layers.batch_invariant import ROW_TILE
from deepwell.engine.models.deepseek_v41.weight_formats import (
    SCALE_GROUP,
    dequantize_fp8_blocks,
    dequantize_mxfp4,
)

# Output rows dequantised at once: a multiple of the 32-row scale blocks, ~4M weights.
_BAND_ELEMENTS = 1 << 22


def fp8_block_linear(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """x [rows, in] float32/bfloat16; weight float8_e4m3fn [out, in]; scale float8_e8m0fnu
    [ceil(out/32), ceil(in/32)] → float32 [rows, out] = x @ dequantize(weight, scale).T."""
    out_features, in_features = weight.shape
    band = _band_rows(in_features)
    x = x.float()
    parts = []
    for start in range(0, out_features, band):
        block = slice(start // SCALE_GROUP, -(-(start + band) // SCALE_GROUP))
        dense = dequantize_fp8_blocks(weight[start : start + band], scale[block])
        parts.append(_tiled_product(x, dense))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def bf16_linear(x: Tensor, weight: Tensor) -> Tensor:
    """weight bfloat16 [out, in] → float32 [rows, out] = x.float() @ weight.float().T, the
    weight converted a band of rows at a time."""
    out_features, in_features = weight.shape
    band = _band_rows(in_features)
    x = x.float()
    parts = [
        _tiled_product(x, weight[start : start + band].float())
        for start in range(0, out_features, band)
    ]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


@dataclass(frozen=True)
class MxFp4Experts:
    """A bank of routed experts in MXFP4 (index = slot): per expert w1/w3 int8
    [inter, hidden/2] with E8M0 scales [inter, ceil(hidden/32)], w2 int8 [hidden, inter/2]
    with E8M0 scales [hidden, ceil(inter/32)]."""

    w1: tuple[Tensor, ...]
    w1_scale: tuple[Tensor, ...]
    w3: tuple[Tensor, ...]
    w3_scale: tuple[Tensor, ...]
    w2: tuple[Tensor, ...]
    w2_scale: tuple[Tensor, ...]

    @classmethod
    def from_tensors(cls, w1, w1_scale, w3, w3_scale, w2, w2_scale) -> MxFp4Experts:
        parts = (w1, w1_scale, w3, w3_scale, w2, w2_scale)
        if len({len(part) for part in parts}) != 1:
            raise ValueError("every expert needs its w1, w3 and w2 with their scales")
        return cls(*(tuple(part) for part in parts))

    @property
    def num_experts(self) -> int:
        return len(self.w1)

    @property
    def hidden_size(self) -> int:
        return self.w2[0].shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w1[0].shape[0]


def mxfp4_experts(
    x: Tensor, slots: Tensor, weights: Tensor, experts: MxFp4Experts, limit: float
) -> Tensor:
    """x [pairs, hidden]; slots int64 [pairs]; weights float32 [pairs] → float32
    [pairs, hidden]: row p = weights[p] * W2_e(silu(min(W1_e x_p, limit)) *
    clamp(W3_e x_p, -limit, limit)) with e = slots[p]."""
    out = torch.empty(x.shape[0], experts.hidden_size, dtype=torch.float32)
    x = x.float()
    for slot in torch.unique(slots).tolist():
        picked = (slots == slot).nonzero().squeeze(1)
        w1 = dequantize_mxfp4(experts.w1[slot], experts.w1_scale[slot])
        w3 = dequantize_mxfp4(experts.w3[slot], experts.w3_scale[slot])
        w2 = dequantize_mxfp4(experts.w2[slot], experts.w2_scale[slot])
        rows, row_weights = _padded(x[picked]), _padded(weights[picked].float().unsqueeze(1))
        # Whole tiles through the elementwise steps too: their vector and scalar paths
        # round differently, so a row must not land in a tail that depends on the count.
        tiles = [
            (F.silu((tile @ w1.T).clamp(max=limit)) * (tile @ w3.T).clamp(-limit, limit))
            * tile_weights
            @ w2.T
            for tile, tile_weights in zip(
                rows.split(ROW_TILE), row_weights.split(ROW_TILE), strict=True
            )
        ]
        out[picked] = torch.cat(tiles)[: picked.numel()]
    return out


def _band_rows(in_features: int) -> int:
    return max(SCALE_GROUP, _BAND_ELEMENTS // max(in_features, 1) // SCALE_GROUP * SCALE_GROUP)


def _tiled_product(x: Tensor, dense: Tensor) -> Tensor:
    """x [rows, in] @ dense [out, in].T in zero-padded ROW_TILE-row calls (float32)."""
    if not x.shape[0]:
        return x.new_zeros(0, dense.shape[0])
    return torch.cat([tile @ dense.T for tile in _padded(x).split(ROW_TILE)])[: x.shape[0]]


def _padded(x: Tensor) -> Tensor:
    """x zero-padded to whole ROW_TILE-row tiles."""
    return F.pad(x, (0, 0, 0, -x.shape[0] % ROW_TILE))
