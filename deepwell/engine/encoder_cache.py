"""EncoderCache: the embeddings of recently seen images, keyed by their content hash, so a
repeated image is not encoded again; least recently used first out past its byte budget."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from deepwell.engine.multimodal import ImageInput

# About 40 of the released model's largest images (1024 span rows of 4096 bf16 values).
DEFAULT_CAPACITY_BYTES = 512 * 2**20


class EncoderCache:
    def __init__(
        self,
        encode: Callable[[ImageInput], torch.Tensor],
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    ) -> None:
        """`encode`: an image → its span's embeddings [span, hidden] (the model's encoder)."""
        self._encode = encode
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def embeddings(self, image: ImageInput) -> torch.Tensor:
        """The image's span embeddings, encoded now only if not held."""
        cached = self._entries.get(image.content_hash)
        if cached is not None:
            self.hits += 1
            self._entries.move_to_end(image.content_hash)
            return cached
        self.misses += 1
        encoded = self._encode(image)
        size = encoded.numel() * encoded.element_size()
        # One image larger than the whole budget is used once and not kept.
        if size <= self.capacity_bytes:
            while self.num_bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= evicted.numel() * evicted.element_size()
            self._entries[image.content_hash] = encoded
            self.num_bytes += size
        return encoded
