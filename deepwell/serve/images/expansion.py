"""Each image placeholder of an encoded prompt → the image's span of token positions.

The recipe renders one `<｜image｜>` per image (byte-exact with deepseek-recipe 0.2.0); the
model reads a span per image: a start, `llm_height` rows of `llm_width` image tokens each
ended by a newline, and an end, every position carrying the checkpoint's `image_token_id`
(nemo-automodel 0.7.0's processor). docs/serve.md, "Images", says how the ids were settled.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepwell.serve.images.grid import ImageGrid


def expand_image_placeholders(
    prompt_ids: Sequence[int], placeholder_id: int, image_token_id: int, grids: Sequence[ImageGrid]
) -> tuple[list[int], list[int]]:
    """The prompt with the i-th `placeholder_id` replaced by the i-th image's span, and the
    position each span starts at.

    ValueError when the prompt holds another number of placeholders than there are images.
    """
    found = sum(1 for token in prompt_ids if token == placeholder_id)
    if found != len(grids):
        raise ValueError(f"the prompt has {found} image placeholders for {len(grids)} images")
    expanded: list[int] = []
    offsets: list[int] = []
    images = iter(grids)
    for token in prompt_ids:
        if token != placeholder_id:
            expanded.append(token)
            continue
        offsets.append(len(expanded))
        expanded.extend([image_token_id] * next(images).num_tokens)
    return expanded, offsets
