"""EncoderCache: an image is encoded once while held; the least recently used goes first."""

import numpy as np
import torch

from deepwell.engine.encoder_cache import EncoderCache
from deepwell.engine.multimodal import ImageInput


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
