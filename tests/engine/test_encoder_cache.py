"""EncoderCache: an image is encoded once while held; the least recently used goes first;
embeddings computed elsewhere are put in and travel between processes unchanged."""

import numpy as np
import pytest
import torch

from deepwell.engine.encoder_cache import EncoderCache, from_image_embedding, to_image_embedding
from deepwell.engine.multimodal import ImageEmbedding, ImageInput


def image(content_hash: str) -> ImageInput:
    return ImageInput(content_hash, (1, 1), np.zeros((1, 3, 2, 2), dtype=np.float32), 0)


def test_a_held_image_is_not_encoded_again_and_the_oldest_leaves_past_the_budget():
    encoded = []

    def encode(item: ImageInput) -> torch.Tensor:
        encoded.append(item.content_hash)
        return torch.full((4, 8), float(len(encoded)))  # 128 bytes

    cache = EncoderCache(encode, capacity_bytes=256)
    first = cache.embeddings(image("a"))
    assert torch.equal(cache.embeddings(image("a")), first)
    cache.embeddings(image("b"))
    cache.embeddings(image("a"))  # now the most recent
    cache.embeddings(image("c"))  # evicts b
    assert ("a" in cache, "b" in cache, "c" in cache) == (True, False, True)
    cache.embeddings(image("b"))
    assert encoded == ["a", "b", "c", "b"]
    assert (cache.hits, cache.misses, cache.num_bytes) == (2, 4, 256)


def test_an_image_larger_than_the_budget_is_used_but_not_kept():
    cache = EncoderCache(lambda item: torch.zeros(100, 100), capacity_bytes=1000)
    assert cache.embeddings(image("big")).shape == (100, 100)
    assert len(cache) == 0 and cache.num_bytes == 0


def test_put_embeddings_are_served_without_encoding_and_replace_an_older_entry():
    cache = EncoderCache(lambda item: pytest.fail("encoded"), capacity_bytes=256)
    cache.put("a", torch.zeros(4, 8))
    cache.put("a", torch.ones(4, 8))
    assert torch.equal(cache.embeddings(image("a")), torch.ones(4, 8))
    assert (cache.hits, cache.misses, cache.num_bytes) == (1, 0, 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_image_embedding_comes_back_bit_for_bit(dtype):
    values = torch.randn(5, 7).to(dtype)
    embedding = to_image_embedding("h", values)
    assert embedding.dtype == str(dtype).removeprefix("torch.")
    back = from_image_embedding(embedding, torch.device("cpu"))
    assert back.dtype == dtype and torch.equal(back, values)


def test_an_embedding_whose_values_contradict_its_dtype_is_refused():
    embedding = ImageEmbedding("h", "float32", np.zeros((2, 2), dtype=np.float64))
    with pytest.raises(ValueError, match="values are torch.float64, the embedding says"):
        from_image_embedding(embedding, torch.device("cpu"))
