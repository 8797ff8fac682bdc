"""Image bytes → the normalised patch array the vision tower reads, with the decode checks.

Runs in the multimodal pool's processes (pool.py): everything here is picklable and
torch-free. Resize, pad and normalisation are the reference's (nemo-automodel 0.7.0,
`_preprocess_image`): PIL's bicubic resize, gray padding, (x / 255 - 0.5) / 0.5 in float32.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from deepwell.serve.images.grid import PAD_COLOR, ImageGrid, VisionSpec, plan_image_grid

# The formats the dialects promise (recipe/dialects/images.py's UNSUPPORTED_IMAGE message).
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP")


class ImageRejected(ValueError):
    """An image that cannot be used; the message says why, without the request path."""


@dataclass(frozen=True)
class PixelLimits:
    """What one image may be before it is decoded (serve --max-image-bytes, --max-image-pixels)."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000


@dataclass(frozen=True)
class PreparedImage:
    """One image as the engine takes it: patches in the reference's layout and its plan."""

    # sha256 of the image's bytes: the encoder cache's and the prefix keys' name for it.
    content_hash: str
    grid: ImageGrid
    # float32 [vit_height * vit_width, 3, patch, patch], row-major patches; the tower rounds
    # them to bf16 as the reference does.
    pixel_values: np.ndarray


def decode_image(data: bytes, limits: PixelLimits) -> Image.Image:
    """The RGB image in `data`; ImageRejected names the limit or the fault."""
    if len(data) > limits.max_bytes:
        raise ImageRejected(
            f"the image is {len(data)} bytes, more than the limit of {limits.max_bytes} "
            "(serve --max-image-bytes)"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise ImageRejected("the image data is not an image PIL can read") from None
    except Image.DecompressionBombError as error:
        raise ImageRejected(f"the image has too many pixels ({error})") from None
    if image.format not in IMAGE_FORMATS:
        raise ImageRejected(
            f"the image is {image.format}; supported formats are png, jpeg, gif and webp"
        )
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageRejected(f"the image is {width}x{height} pixels; it needs at least one")
    if width * height > limits.max_pixels:
        raise ImageRejected(
            f"the image is {width}x{height} = {width * height} pixels, more than the limit "
            f"of {limits.max_pixels} (serve --max-image-pixels)"
        )
    try:
        with warnings.catch_warnings():
            # Our own pixel limit is checked above; PIL's bomb warning would only repeat it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ImageRejected(f"the image data is corrupt ({error})") from None


def image_patches(image: Image.Image, spec: VisionSpec) -> tuple[np.ndarray, ImageGrid]:
    """The RGB image resized onto its grid and cut into patches (see PreparedImage)."""
    grid = plan_image_grid(image.width, image.height, spec)
    size = (grid.width, grid.height)
    if spec.max_wh_ratio is not None and image.width >= spec.max_wh_ratio * image.height:
        drawn = image.resize(size, Image.Resampling.BICUBIC)
    else:
        drawn = ImageOps.pad(image, size, Image.Resampling.BICUBIC, color=PAD_COLOR)
    pixels = np.asarray(drawn, dtype=np.float32).transpose(2, 0, 1) / np.float32(255)
    pixels = (pixels - np.float32(0.5)) / np.float32(0.5)
    patch = spec.patch_size
    patches = (
        pixels.reshape(3, grid.vit_height, patch, grid.vit_width, patch)
        .transpose(1, 3, 0, 2, 4)
        .reshape(grid.num_patches, 3, patch, patch)
    )
    return np.ascontiguousarray(patches), grid


def prepare_image(data: bytes, spec: VisionSpec, limits: PixelLimits) -> PreparedImage:
    """Decode, check, resize and patch one image's bytes."""
    image = decode_image(data, limits)
    try:
        patches, grid = image_patches(image, spec)
    except ValueError as error:
        raise ImageRejected(str(error)) from None
    return PreparedImage(hashlib.sha256(data).hexdigest(), grid, patches)
