"""The multimodal pool: the same images with and without it, its settings from the
environment, and the first bad image named by its ordinal and part."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from deepwell.recipe.conversation import BytesImageSource, UrlImageSource
from deepwell.serve.images.grid import VisionSpec
from deepwell.serve.images.media import MediaAccess
from deepwell.serve.images.pixels import PixelLimits
from deepwell.serve.images.pool import ImageFault, ImagePreprocessor, PoolConfig

SPEC = VisionSpec(image_token_id=7, patch_size=4, downsample_ratio=2, max_image_tokens=40)


def image(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


def preprocessor(enabled: bool, **access) -> ImagePreprocessor:
    return ImagePreprocessor(SPEC, PixelLimits(), MediaAccess(**access), PoolConfig(enabled, 2))


def test_the_pool_prepares_what_the_request_thread_prepares():
    sources = [BytesImageSource(image(30, 20), path=".messages[0]"), BytesImageSource(image(9, 50))]
    pooled = preprocessor(True)
    try:
        with_pool = pooled.prepare(sources)
    finally:
        pooled.close()
    without = preprocessor(False).prepare(sources)
    for a, b in zip(with_pool, without, strict=True):
        assert a.content_hash == b.content_hash and a.grid == b.grid
        assert np.array_equal(a.pixel_values, b.pixel_values)


def test_the_first_bad_image_is_named():
    sources = [BytesImageSource(image(8, 8)), BytesImageSource(b"junk", path=".messages[2]")]
    with pytest.raises(ImageFault, match=r"^image 2 \(messages\[2\]\): the image data is not"):
        preprocessor(False).prepare(sources)
    remote = [UrlImageSource("https://elsewhere.example/a.png", path=".messages[0]")]
    with pytest.raises(ImageFault, match="not allowed .allowed: ok.example"):
        preprocessor(False, allowed_domains=("ok.example",)).prepare(remote)


def test_pool_settings_come_from_the_environment():
    assert PoolConfig.from_environment({}).enabled is True
    off = PoolConfig.from_environment({"DEEPWELL_USE_MULTIMODAL_POOL": "0"})
    assert off.enabled is False
    assert PoolConfig.from_environment({"DEEPWELL_MULTIMODAL_POOL_SIZE": "3"}).size == 3
    with pytest.raises(ValueError, match="DEEPWELL_MULTIMODAL_POOL_SIZE must be in"):
        PoolConfig.from_environment({"DEEPWELL_MULTIMODAL_POOL_SIZE": "0"})
