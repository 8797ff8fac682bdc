"""An image request through the official SDKs on a real `deepwell serve` of a tiny
DeepSeek-V4.1 checkpoint with a vision tower gives the greedy tokens the offline engine
(`LLM.generate(multi_modal_data=...)`) gives for the same prompt and image.

Greedy needs the non-thinking mode (thinking samples at temperature 1 whatever is asked,
spec/recipe.md §6.1), asked for in each dialect's own way. Float32 on both sides: a random tiny model's logits lie close together, and prefix-cache
hits between the requests must not tip an argmax (fp32 chunked and whole prefill agree
within 1e-5, tests/engine/models/deepseek_v41/test_vision_parity.py). Chat shows its prompt
and output ids (`return_token_ids`), which the offline engine is checked against; Responses
and Messages render the same conversation, so they must give the same text as Chat.
"""

from __future__ import annotations

import base64
import io
import json

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from servers import V41_ARGS, start_server, write_v41_checkpoint

from deepwell.engine import LLM, SamplingParams
from deepwell.engine.multimodal import ImageInput, image_span_length
from deepwell.serve.images.grid import VisionSpec
from deepwell.serve.images.pixels import PixelLimits, prepare_image

# A checkpoint, a server and an offline engine: minutes on a shared CPU.
pytestmark = pytest.mark.slow

MAX_TOKENS = 8

QUESTION = "What is this?"


def picture(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


IMAGE = picture(40, 30, seed=1)
# Another image of the same size: the same prompt ids, different embeddings.
OTHER_IMAGE = picture(40, 30, seed=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41-vision"), vision=True)


@pytest.fixture(scope="module")
def vision_server(checkpoint):
    server = start_server(
        checkpoint.parent, "--model", str(checkpoint), *V41_ARGS, "--dtype", "float32"
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offline(checkpoint):
    args = dict(dtype="float32", num_threads=1, max_model_len=4096, memory_gib=1)
    with LLM(str(checkpoint), decode_sequence=False, **args) as llm:
        yield llm


@pytest.fixture(scope="module")
def vision_spec(checkpoint) -> VisionSpec:
    return VisionSpec.from_config(json.loads((checkpoint / "config.json").read_text()))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_with_ids(server, image: bytes):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    return client.chat.completions.create(
        model=server.model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                ],
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "thinking": {"type": "disabled"}},
    )


def offline_tokens(
    llm: LLM, prompt_ids: list[int], image: bytes, spec: VisionSpec, offset: int
) -> list[int]:
    prepared = prepare_image(image, spec, PixelLimits())
    grid = (prepared.grid.vit_height, prepared.grid.vit_width)
    images = [ImageInput(prepared.content_hash, grid, prepared.pixel_values, offset)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    [completion] = llm.generate(
        prompt_token_ids=[prompt_ids],
        sampling_params=params,
        multi_modal_data=[images],
        use_tqdm=False,
    )
    return completion.token_ids


def image_span(prompt_ids: list[int], image_token_id: int) -> tuple[int, int]:
    positions = [i for i, token in enumerate(prompt_ids) if token == image_token_id]
    assert positions == list(range(positions[0], positions[-1] + 1)), "one contiguous span"
    return positions[0], len(positions)


def chat_text(reply) -> str:
    return reply.choices[0].message.content


def test_chat_image_gives_the_offline_engines_tokens_and_shows_its_span(
    vision_server, offline, vision_spec
):
    reply = chat_with_ids(vision_server, IMAGE)
    prompt_ids = reply.model_extra["prompt_token_ids"]
    offset, length = image_span(prompt_ids, vision_spec.image_token_id)
    grid = prepare_image(IMAGE, vision_spec, PixelLimits()).grid
    assert length == image_span_length(
        (grid.vit_height, grid.vit_width), vision_spec.downsample_ratio
    )
    tokens = reply.choices[0].model_extra["token_ids"]
    assert len(tokens) == MAX_TOKENS
    assert tokens == offline_tokens(offline, prompt_ids, IMAGE, vision_spec, offset)


def test_the_image_not_only_its_size_decides_the_tokens(vision_server, offline, vision_spec):
    first, second = chat_with_ids(vision_server, IMAGE), chat_with_ids(vision_server, OTHER_IMAGE)
    prompt_ids = second.model_extra["prompt_token_ids"]
    assert prompt_ids == first.model_extra["prompt_token_ids"]
    offset, _ = image_span(prompt_ids, vision_spec.image_token_id)
    tokens = second.choices[0].model_extra["token_ids"]
    assert tokens == offline_tokens(offline, prompt_ids, OTHER_IMAGE, vision_spec, offset)
    assert tokens != first.choices[0].model_extra["token_ids"]


def test_responses_input_image_answers_as_chat_does(vision_server):
    expected = chat_text(chat_with_ids(vision_server, IMAGE))
    client = openai.OpenAI(base_url=f"{vision_server.base_url}/v1", api_key="-", max_retries=0)
    response = client.responses.create(
        model=vision_server.model,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": data_url(IMAGE), "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        reasoning={"effort": "none"},
    )
    assert response.output_text == expected
    assert response.usage.output_tokens == MAX_TOKENS


def test_messages_image_block_answers_as_chat_does(vision_server):
    expected = chat_text(chat_with_ids(vision_server, IMAGE))
    client = anthropic.Anthropic(base_url=vision_server.base_url, api_key="-", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE).decode()}
    message = client.messages.create(
        model=vision_server.model,
        max_tokens=MAX_TOKENS,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image", "source": source},
                ],
            }
        ],
        thinking={"type": "disabled"},
        # The SDK has no temperature argument; the API has the field.
        extra_body={"temperature": 0},
    )
    assert "".join(block.text for block in message.content) == expected
    assert message.usage.output_tokens == MAX_TOKENS


def test_tokenize_expands_the_image_as_the_chat_request_does(vision_server):
    reply = chat_with_ids(vision_server, IMAGE)
    body = {
        "model": vision_server.model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
                ],
            }
        ],
        "thinking": {"type": "disabled"},
    }
    tokenized = httpx.post(f"{vision_server.base_url}/tokenize", json=body, timeout=60).json()
    assert tokenized["tokens"] == reply.model_extra["prompt_token_ids"]
