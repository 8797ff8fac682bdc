"""How DeepSeek-V4.1's released weights are stored (spec §3.8): formats, shapes and bytes.

Torch-free, so that the memory planner (engine/plan.py) sizes a checkpoint from its
config.json alone; weight_formats.py reads and writes the values.
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCALE_GROUP = 32  # every scale covers 32 columns (and 32 rows for the dense FP8 blocks)
SCALE_BYTES = 1  # F8_E8M0


class WeightFormat(enum.Enum):
    """How one released tensor is stored; the quantised ones carry a `.scale` beside them."""

    BF16 = "bf16"
    F32 = "f32"
    # F8_E4M3 [rows, cols], scale [ceil(rows/32), ceil(cols/32)]: one per 32x32 block.
    FP8_BLOCKS = "fp8_e4m3_blocks"
    # F8_E4M3 [rows, cols], scale [rows, ceil(cols/32)]: row-wise groups of 32 (Engram tables).
    FP8_ROWS = "fp8_e4m3_rows"
    # I8 [rows, cols/2] of E2M1 pairs, scale [rows, ceil(cols/32)] (routed experts).
    MXFP4 = "mxfp4"

    @property
    def quantized(self) -> bool:
        return self in (WeightFormat.FP8_BLOCKS, WeightFormat.FP8_ROWS, WeightFormat.MXFP4)

    @property
    def safetensors_dtype(self) -> str:
        """The safetensors dtype name of the stored weight (its scale is F8_E8M0)."""
        return {
            WeightFormat.BF16: "BF16",
            WeightFormat.F32: "F32",
            WeightFormat.FP8_BLOCKS: "F8_E4M3",
            WeightFormat.FP8_ROWS: "F8_E4M3",
            WeightFormat.MXFP4: "I8",
        }[self]

    @property
    def stored_dtype(self) -> torch.dtype:
        # Imported here: only the loader and the writer ask, and the planner must not load torch.
        import torch

        return {
            WeightFormat.BF16: torch.bfloat16,
            WeightFormat.F32: torch.float32,
            WeightFormat.FP8_BLOCKS: torch.float8_e4m3fn,
            WeightFormat.FP8_ROWS: torch.float8_e4m3fn,
            WeightFormat.MXFP4: torch.int8,
        }[self]

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored weight's shape for a logical [rows, cols] (or any plain) shape."""
        if self is WeightFormat.MXFP4:
            rows, cols = matrix_shape(shape, self.value)
            if cols % 2:
                raise ValueError(f"MXFP4 packs column pairs; {cols} columns is odd")
            return (rows, cols // 2)
        return tuple(shape)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """The `.scale` tensor's shape for a logical [rows, cols], or None for plain formats."""
        if not self.quantized:
            return None
        rows, cols = matrix_shape(shape, self.value)
        row_block = SCALE_GROUP if self is WeightFormat.FP8_BLOCKS else 1
        return (math.ceil(rows / row_block), math.ceil(cols / SCALE_GROUP))

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the stored weight and its scale for a logical shape."""
        weight = math.prod(self.stored_shape(shape)) * _ELEMENT_BYTES[self]
        scale = self.scale_shape(shape)
        return weight + (0 if scale is None else math.prod(scale) * SCALE_BYTES)


_ELEMENT_BYTES = {
    WeightFormat.BF16: 2,
    WeightFormat.F32: 4,
    WeightFormat.FP8_BLOCKS: 1,
    WeightFormat.FP8_ROWS: 1,
    WeightFormat.MXFP4: 1,  # one I8 holds two E2M1 codes: stored_shape halves the columns
}


def matrix_shape(shape: tuple[int, ...], what: str) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"{what} must be two-dimensional, got shape {list(shape)}")
    return shape[0], shape[1]
