"""The vision tower as a stage of its own: loaded alone from a V4.1 directory it computes the
engine's embeddings, and an engine given those embeddings generates the same tokens without
running its own tower."""

import numpy as np
import pytest
import torch

from deepwell.engine import LLM, EngineArgs, SamplingParams
from deepwell.engine.encoder_cache import from_image_embedding, to_image_embedding
from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.writer import TINY_VISION_CONFIG, write_tiny_checkpoint
from deepwell.engine.models.registry import build_image_encoder
from deepwell.engine.multimodal import ImageInput, image_span_length

PATCH = TINY_VISION_CONFIG["patch_size"]
GRID = (7, 10)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v41_vision")
    return write_tiny_checkpoint(path, vision_config=TINY_VISION_CONFIG, keep_weights=False)


def offline(checkpoint) -> LLM:
    args = EngineArgs(
        model=str(checkpoint.path),
        dtype="float32",
        quantize_kv_cache=False,
        max_model_len=512,
        block_size=16,
        memory_gib=0.5,
    )
    return LLM(**vars(args), decode_sequence=False)


def image_prompt(checkpoint) -> tuple[list[int], ImageInput]:
    token = checkpoint.config["image_token_id"]
    rows, cols = GRID
    pixels = np.random.default_rng(3).uniform(-1, 1, (rows * cols, 3, PATCH, PATCH))
    image = ImageInput("image-3", GRID, pixels.astype(np.float32), 5)
    span = image_span_length(GRID, TINY_VISION_CONFIG["downsample_ratio"])
    return [11] * 5 + [token] * span + [12] * 4, image


def generate(llm: LLM, ids: list[int], image: ImageInput) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [completion] = llm.generate(
        prompt_token_ids=[ids], sampling_params=params, multi_modal_data=[[image]], use_tqdm=False
    )
    return completion.token_ids


def test_embeddings_from_the_tower_alone_give_the_engines_tokens_without_its_tower(checkpoint):
    ids, image = image_prompt(checkpoint)
    with offline(checkpoint) as whole:
        expected = generate(whole, ids, image)
        engine_tower = whole.core.runner.encoder_cache.embeddings(image)
    tower = build_image_encoder(str(checkpoint.path), torch.float32)
    embedding = to_image_embedding(image.content_hash, tower(image))
    assert torch.equal(from_image_embedding(embedding, torch.device("cpu")), engine_tower)
    with offline(checkpoint) as given:
        given.core.provide_image_embeddings([embedding])
        assert generate(given, ids, image) == expected
        assert given.core.runner.encoder_cache.misses == 0


def test_a_checkpoint_without_a_vision_tower_has_nothing_for_an_encoder_worker(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "text", keep_weights=False).path
    with pytest.raises(ModelLoadError, match="has no vision tower"):
        build_image_encoder(str(path), torch.float32)
