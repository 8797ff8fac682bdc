"""An image as the engine takes it: preprocessed patches, their grid, and the prompt span the
image's embeddings fill. Torch-free, so the serving layer builds it without the engine.

The span is DeepSeek-V4.1's image layout (nemo-automodel 0.7.0 deepseek_v41/processing.py):
one start token, then per row of merged patches that many content tokens and a newline,
then one end token; every position of the span holds the checkpoint's `image_token_id`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepwell.engine.errors import InvalidRequestError


class ImageToken(enum.IntEnum):
    """What each position of an image span carries (the reference's vision token types)."""

    START = 0
    CONTENT = 1
    NEWLINE = 2
    END = 3


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image of a prompt.

    `pixel_values`: float32 [rows * cols, 3, patch, patch], the normalised RGB patches in
    row-major order (the reference's layout; the engine rounds them to bf16 as it does).
    `grid`: (rows, cols) of ViT patches. `offset`: the prompt position of the span's start
    token; the span covers `image_span_length(grid, downsample_ratio)` positions.
    `content_hash`: a digest of the image's content (hex), the key of the encoder cache and
    part of the prefix-cache block keys: two images with one hash are the same image.
    """

    content_hash: str
    grid: tuple[int, int]
    pixel_values: np.ndarray
    offset: int

    def __post_init__(self) -> None:
        # A grid that travelled as a list (msgpack) comes back as the tuple it was.
        object.__setattr__(self, "grid", tuple(self.grid))

    def span_length(self, downsample_ratio: int) -> int:
        return image_span_length(self.grid, downsample_ratio)


@dataclass(frozen=True, eq=False)
class ImageEmbedding:
    """One image's span embeddings computed elsewhere (an encoder worker), for the engine's
    encoder cache under the image's `content_hash`.

    `values`: [span, hidden] as the encoder computed them, in torch's `dtype` (its name,
    e.g. "bfloat16"); bfloat16, which numpy lacks, is carried as its uint16 bit patterns.
    """

    content_hash: str
    dtype: str
    values: np.ndarray


def merged_grid(grid: tuple[int, int], downsample_ratio: int) -> tuple[int, int]:
    """(rows, cols) of text-width embeddings after the aligner merges ratio² patches (the
    grid padded up to whole cells)."""
    rows, cols = grid
    return -(-rows // downsample_ratio), -(-cols // downsample_ratio)


def image_span_length(grid: tuple[int, int], downsample_ratio: int) -> int:
    """Prompt positions of an image with this ViT patch grid: start, rows of content and a
    newline, end."""
    rows, cols = merged_grid(grid, downsample_ratio)
    return rows * (cols + 1) + 2


def image_token_kinds(grid: tuple[int, int], downsample_ratio: int) -> list[ImageToken]:
    """What each position of the image's span carries, in order."""
    rows, cols = merged_grid(grid, downsample_ratio)
    row = [ImageToken.CONTENT] * cols + [ImageToken.NEWLINE]
    return [ImageToken.START, *(row * rows), ImageToken.END]


def image_spans(
    images: Sequence[ImageInput], downsample_ratio: int
) -> tuple[tuple[int, int, str], ...]:
    """Each image's (first position, end position, content hash) in the prompt."""
    return tuple(
        (image.offset, image.offset + image.span_length(downsample_ratio), image.content_hash)
        for image in images
    )


def check_images(
    images: Sequence[ImageInput],
    prompt_token_ids: Sequence[int],
    image_token_id: int,
    downsample_ratio: int,
    patch_size: int,
) -> None:
    """Raise InvalidRequestError naming the image at fault unless every image fits its
    span: inside the prompt, in prompt order without overlap, each position the image
    token, and patches matching the grid."""
    end_of_previous = 0
    for index, image in enumerate(images):
        name = f"image {index}"
        if not isinstance(image, ImageInput):
            raise InvalidRequestError(f"{name}: expected ImageInput, got {type(image).__name__}")
        rows, cols = image.grid
        if rows <= 0 or cols <= 0:
            raise InvalidRequestError(f"{name}: its patch grid {image.grid} is empty")
        expected = (rows * cols, 3, patch_size, patch_size)
        pixels = image.pixel_values
        if not isinstance(pixels, np.ndarray) or pixels.shape != expected:
            shape = getattr(pixels, "shape", type(pixels).__name__)
            raise InvalidRequestError(
                f"{name}: pixel_values {tuple(shape) if shape else shape} do not match its "
                f"{rows}x{cols} grid of {patch_size}-pixel patches {expected}"
            )
        length = image.span_length(downsample_ratio)
        start, end = image.offset, image.offset + length
        if start < end_of_previous or end > len(prompt_token_ids):
            raise InvalidRequestError(
                f"{name}: its span [{start}, {end}) is outside the prompt of "
                f"{len(prompt_token_ids)} tokens or overlaps the image before it"
            )
        wrong = [p for p in range(start, end) if prompt_token_ids[p] != image_token_id]
        if wrong:
            raise InvalidRequestError(
                f"{name}: prompt position {wrong[0]} of its span [{start}, {end}) holds token "
                f"{prompt_token_ids[wrong[0]]}, not the image token {image_token_id}"
            )
        end_of_previous = end
