"""How large an image is drawn for the vision tower: its resized size, ViT patch grid and
the rows and columns of image tokens it becomes, as DeepSeek-V4.1 plans them.

The plan follows nemo-automodel 0.7.0's `deepseek_v41/processing.py` (the released resize):
small images grow to `min_pixels`, large ones shrink until their token span fits
`max_image_tokens`; tests/serve/images/test_grid.py checks it against that reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Gray the reference pads with where the aspect ratio leaves room.
PAD_COLOR = (127, 127, 127)


@dataclass(frozen=True)
class VisionSpec:
    """What preprocessing needs of a checkpoint's vision config (config.json)."""

    # The id every position of an image span carries (config.json's `image_token_id`).
    image_token_id: int
    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    # Wider than this many heights: stretched instead of padded (None: never).
    max_wh_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("patch_size", "downsample_ratio", "min_pixels"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"vision_config.{name} must be a positive integer, got {value!r}")
        if type(self.max_image_tokens) is not int or self.max_image_tokens < 4:
            raise ValueError(
                f"vision_config.max_image_tokens must be an integer >= 4, got "
                f"{self.max_image_tokens!r}"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionSpec | None:
        """The spec of a V4.1 config.json; None when it has no vision tower (no
        vision_config, or one of zero layers)."""
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping) or not vision.get("num_hidden_layers"):
            return None
        known = ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels")
        given = {name: vision[name] for name in known if name in vision}
        return cls(
            image_token_id=int(config["image_token_id"]),
            max_wh_ratio=vision.get("max_wh_ratio"),
            **given,
        )


@dataclass(frozen=True)
class ImageGrid:
    """One image's plan: resized pixels, ViT patches, and image-token rows and columns."""

    height: int
    width: int
    vit_height: int
    vit_width: int
    llm_height: int
    llm_width: int

    @property
    def num_patches(self) -> int:
        return self.vit_height * self.vit_width

    @property
    def num_tokens(self) -> int:
        """Start, each row of image tokens with its newline, end."""
        return span_length(self.llm_height, self.llm_width)


def span_length(rows: int, columns: int) -> int:
    return rows * (columns + 1) + 2


def plan_image_grid(width: int, height: int, spec: VisionSpec) -> ImageGrid:
    """The grid an image of `width` x `height` pixels is drawn on; ValueError when none fits."""
    if width <= 0 or height <= 0:
        raise ValueError(f"the image is {width}x{height} pixels; it needs at least one")
    logical_width: float = width
    logical_height: float = height
    if spec.max_wh_ratio is not None and width > height * spec.max_wh_ratio:
        logical_width = height * spec.max_wh_ratio
    if logical_width * logical_height < spec.min_pixels:
        # The reference truncates the grown size to whole pixels.
        scale = (spec.min_pixels / (logical_width * logical_height)) ** 0.5
        logical_width, logical_height = int(logical_width * scale), int(logical_height * scale)
    patch = spec.patch_size
    best_width = math.ceil(logical_width / patch) * patch
    best_height = math.ceil(logical_height / patch) * patch
    rows, columns = _token_shape(best_height, best_width, spec)
    if span_length(rows, columns) > spec.max_image_tokens:
        best_height, best_width = _shrunk_size(logical_width, logical_height, spec)
        rows, columns = _token_shape(best_height, best_width, spec)
    if min(best_height, best_width) <= 0 or span_length(rows, columns) > spec.max_image_tokens:
        raise ValueError(
            f"a {width}x{height} image cannot fit in {spec.max_image_tokens} image tokens"
        )
    return ImageGrid(
        best_height, best_width, best_height // patch, best_width // patch, rows, columns
    )


def _token_shape(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    patch, downsample = spec.patch_size, spec.downsample_ratio
    return math.ceil(height // patch / downsample), math.ceil(width // patch / downsample)


def _shrunk_size(width: float, height: float, spec: VisionSpec) -> tuple[int, int]:
    """The largest patch-aligned (height, width) of this aspect whose span fits the budget.

    rows * (columns + 1) + 2 <= budget with rows = columns * aspect solves to the quadratic
    below; a sliver too thin for one cell is given one cell across.
    """
    budget = spec.max_image_tokens
    aspect = height / width
    max_columns = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    max_rows = max_columns * aspect
    patch = spec.patch_size
    cell = patch * spec.downsample_ratio
    if max_columns < 1:
        return (budget - 2) // 2 * cell, cell
    if max_rows < 1:
        return cell, (budget - 3) * cell
    scale = min(math.floor(max_columns) * cell / width, math.floor(max_rows) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch
