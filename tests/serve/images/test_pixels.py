"""Grid plan, resize and patches against nemo-automodel 0.7.0's V4.1 processor, and the
checks a bad image meets before it is decoded."""

from __future__ import annotations

import io
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from nemo_automodel.components.models.deepseek_v41 import processing  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.config import (  # noqa: E402
    DeepseekV41VisionConfig,
)
from PIL import Image  # noqa: E402

from deepwell.serve.images.grid import VisionSpec, plan_image_grid  # noqa: E402
from deepwell.serve.images.pixels import (  # noqa: E402
    ImageRejected,
    PixelLimits,
    prepare_image,
)

# The released config: patch 14, downsample 3, at most 1024 image tokens, min_pixels 295936.
RELEASED = VisionSpec(image_token_id=129264)
SIZES = [
    (1, 1),
    (640, 480),
    (480, 640),
    (1920, 1080),
    (4000, 3000),
    (3000, 40),
    (40, 3000),
    (5000, 7),
    (7, 5000),
    (543, 544),
    (12000, 9000),
]


def nemo_vision(spec: VisionSpec) -> DeepseekV41VisionConfig:
    return DeepseekV41VisionConfig(
        patch_size=spec.patch_size,
        downsample_ratio=spec.downsample_ratio,
        max_image_tokens=spec.max_image_tokens,
        min_pixels=spec.min_pixels,
        max_wh_ratio=spec.max_wh_ratio,
    )


def png_bytes(width: int, height: int, seed: int, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


@pytest.mark.parametrize("width,height", SIZES)
@pytest.mark.parametrize("spec", [RELEASED, VisionSpec(129264, max_wh_ratio=4.0)])
def test_grid_plan_is_the_reference_plan(width, height, spec):
    ours = plan_image_grid(width, height, spec)
    theirs = processing._plan_image_grid(width, height, nemo_vision(spec))
    assert (ours.height, ours.width, ours.vit_height, ours.vit_width) == (
        theirs.height,
        theirs.width,
        theirs.vit_height,
        theirs.vit_width,
    )
    assert (ours.llm_height, ours.llm_width) == (theirs.llm_height, theirs.llm_width)
    assert ours.num_tokens <= spec.max_image_tokens
    assert ours.width * ours.height >= min(spec.min_pixels, ours.width * ours.height)


SMALL = VisionSpec(image_token_id=7, patch_size=4, downsample_ratio=2, max_image_tokens=40)


@pytest.mark.parametrize(
    "width,height,mode,spec",
    [
        (30, 20, "RGB", SMALL),
        (17, 45, "RGBA", SMALL),
        (90, 11, "L", SMALL),
        (
            9,
            9,
            "RGB",
            VisionSpec(7, patch_size=4, downsample_ratio=2, max_image_tokens=40, min_pixels=900),
        ),
        (
            64,
            12,
            "RGB",
            VisionSpec(7, patch_size=4, downsample_ratio=2, max_image_tokens=40, max_wh_ratio=2.0),
        ),
        (700, 500, "RGB", RELEASED),
    ],
)
def test_patches_are_the_reference_patches(width, height, mode, spec):
    data = png_bytes(width, height, seed=width * height, mode=mode)
    prepared = prepare_image(data, spec, PixelLimits())
    patches, grid = processing._preprocess_image(data, nemo_vision(spec))
    assert prepared.pixel_values.dtype == np.float32
    assert prepared.pixel_values.shape == tuple(patches.shape)
    assert (prepared.grid.vit_height, prepared.grid.vit_width) == (grid.vit_height, grid.vit_width)
    # The reference hands the tower bf16; ours rounds to exactly the same values.
    ours = torch.from_numpy(prepared.pixel_values).to(torch.bfloat16)
    assert torch.equal(ours, patches)


def test_content_hash_names_the_bytes():
    one = prepare_image(png_bytes(8, 8, seed=1), SMALL, PixelLimits())
    same = prepare_image(png_bytes(8, 8, seed=1), SMALL, PixelLimits())
    other = prepare_image(png_bytes(8, 8, seed=2), SMALL, PixelLimits())
    assert one.content_hash == same.content_hash != other.content_hash


@pytest.mark.parametrize(
    "data,limits,says",
    [
        (b"not an image at all", PixelLimits(), "not an image"),
        (png_bytes(16, 16, 0)[:60], PixelLimits(), "corrupt"),
        (png_bytes(8, 8, 0, fmt="BMP"), PixelLimits(), "BMP"),
        (png_bytes(8, 8, 0), PixelLimits(max_bytes=100), "--max-image-bytes"),
        (png_bytes(100, 50, 0), PixelLimits(max_pixels=4999), "--max-image-pixels"),
    ],
)
def test_bad_images_are_refused_with_their_reason(data, limits, says):
    with pytest.raises(ImageRejected, match=says):
        prepare_image(data, SMALL, limits)


def test_vision_spec_reads_a_released_config():
    config = {
        "image_token_id": 129264,
        "vision_config": {"num_hidden_layers": 32, "patch_size": 14, "min_pixels": 295936},
    }
    assert VisionSpec.from_config(config) == RELEASED
    assert (
        VisionSpec.from_config({"image_token_id": 1, "vision_config": {"num_hidden_layers": 0}})
        is None
    )
    assert VisionSpec.from_config({"image_token_id": 1}) is None
