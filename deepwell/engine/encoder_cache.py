"""EncoderCache: the embeddings of recently seen images, keyed by their content hash, so a
repeated image is not encoded again; least recently used first out past its byte budget.
Embeddings an encoder worker computed are put in ahead of the prefill that reads them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from deepwell.engine.multimodal import ImageEmbedding, ImageInput

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
        # `put` runs on the engine loop's thread while a step's forward reads on the
        # compute thread (asynchronous scheduling).
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def embeddings(self, image: ImageInput) -> torch.Tensor:
        """The image's span embeddings, encoded now only if not held."""
        with self._lock:
            cached = self._entries.get(image.content_hash)
            if cached is not None:
                self.hits += 1
                self._entries.move_to_end(image.content_hash)
                return cached
            self.misses += 1
        encoded = self._encode(image)
        self.put(image.content_hash, encoded)
        return encoded

    def put(self, content_hash: str, embeddings: torch.Tensor) -> None:
        """Hold `embeddings` [span, hidden] as the image's; one larger than the whole budget
        is not kept."""
        size = embeddings.numel() * embeddings.element_size()
        if size > self.capacity_bytes:
            return
        with self._lock:
            previous = self._entries.pop(content_hash, None)
            if previous is not None:
                self.num_bytes -= previous.numel() * previous.element_size()
            while self.num_bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= evicted.numel() * evicted.element_size()
            self._entries[content_hash] = embeddings
            self.num_bytes += size


def to_image_embedding(content_hash: str, embeddings: torch.Tensor) -> ImageEmbedding:
    """An encoder's output as it travels to another process (on the host, dtype kept)."""
    host = embeddings.detach().to("cpu").contiguous()
    dtype = str(host.dtype).removeprefix("torch.")
    if host.dtype == torch.bfloat16:
        return ImageEmbedding(content_hash, dtype, host.view(torch.int16).numpy().view(np.uint16))
    return ImageEmbedding(content_hash, dtype, host.numpy())


def from_image_embedding(embedding: ImageEmbedding, device: torch.device) -> torch.Tensor:
    """The tensor an `ImageEmbedding` carries, on `device`, bit for bit."""
    values = torch.from_numpy(np.ascontiguousarray(embedding.values))
    dtype = getattr(torch, embedding.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"image embedding of {embedding.content_hash}: unknown dtype {embedding.dtype!r}"
        )
    if dtype == torch.bfloat16:
        values = values.view(torch.int16).view(torch.bfloat16)
    elif values.dtype != dtype:
        raise ValueError(
            f"image embedding of {embedding.content_hash}: values are {values.dtype}, "
            f"the embedding says {dtype}"
        )
    return values.to(device)
