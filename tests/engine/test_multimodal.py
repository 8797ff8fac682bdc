"""ImageInput's span layout and the checks intake runs on a request's images."""

import numpy as np
import pytest

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.multimodal import (
    ImageInput,
    ImageToken,
    check_images,
    image_span_length,
    image_token_kinds,
)

IMAGE = 99


def image(grid, offset, patch=4, content_hash="h"):
    pixels = np.zeros((grid[0] * grid[1], 3, patch, patch), dtype=np.float32)
    return ImageInput(content_hash, grid, pixels, offset)


def test_a_span_is_start_rows_of_merged_cells_each_with_a_newline_then_end():
    # 7x10 patches → 3x4 cells of 3x3 (the last row and column padded).
    kinds = image_token_kinds((7, 10), 3)
    row = [ImageToken.CONTENT] * 4 + [ImageToken.NEWLINE]
    assert kinds == [ImageToken.START, *row, *row, *row, ImageToken.END]
    assert image_span_length((7, 10), 3) == len(kinds) == 17
    assert image_span_length((9, 9), 3) == 3 * 4 + 2


def test_images_that_fit_their_spans_pass():
    prompt = [1, 2] + [IMAGE] * 17 + [3] + [IMAGE] * 11
    check_images([image((7, 10), 2), image((8, 5), 20)], prompt, IMAGE, 3, 4)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([image((7, 10), 25)], "image 0: its span \\[25, 42\\) is outside the prompt"),
        ([image((7, 10), 2), image((8, 5), 10)], "image 1: .*overlaps the image before"),
        ([image((7, 10), 1)], "image 0: prompt position 1 .* holds token 2"),
        ([image((7, 10), 2, patch=5)], "image 0: pixel_values .* 4-pixel patches"),
        ([image((0, 3), 2)], "image 0: its patch grid"),
    ],
)
def test_an_image_that_does_not_fit_is_refused_by_its_index(images, message):
    prompt = [1, 2] + [IMAGE] * 17 + [3] + [IMAGE] * 11
    with pytest.raises(InvalidRequestError, match=message):
        check_images(images, prompt, IMAGE, 3, 4)
