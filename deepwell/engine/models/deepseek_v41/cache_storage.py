"""How DeepSeek-V4.1 keeps its window rows, compressed entries and index keys: the shape and
dtype of a layout entry, and the conversion of rows on their way in and out of the cache.

By default the caches hold the released bytes (spec §3.7, §4: 528 B a window row, 288 B a
compressed entry, 68 B an index key) and a step unpacks only the rows it reads. Unpacking
gives exactly the quantise-dequantise values (cache_formats.py), so a step computes with
the same numbers as when the rounded values are kept in the compute dtype (ROUNDED). Rows
unpack, and window rows pack, in C++ (layers/v41_cache_rows.cpp, the same bits) where that
builds, else through cache_formats.py's torch ops.
"""

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from deepwell.engine.layers.decode_kernel import load_cache_rows_kernel
from deepwell.engine.models.deepseek_v41.cache_formats import (
    fp8_row_bytes,
    mxfp4_row_bytes,
    nvfp4_row_bytes,
    pack_fp8,
    pack_mxfp4,
    pack_nvfp4,
    qdq_fp8,
    qdq_mxfp4,
    qdq_nvfp4,
    unpack_fp8,
    unpack_mxfp4,
    unpack_nvfp4,
)
from deepwell.engine.models.deepseek_v41.cache_rows import MXFP4_GROUP, NVFP4_GROUP
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config

logger = logging.getLogger(__name__)


@functools.cache
def native_rows() -> bool:
    """Whether torch.ops.deepwell_v41_cache is registered (the kernel built); logs once if not."""
    loaded = load_cache_rows_kernel()
    if loaded.module is None:
        logger.warning("V4.1 cache rows unpack through torch ops (slower): %s", loaded.reason)
    return loaded.module is not None


class KVStorage(Enum):
    # Unrounded values in the compute dtype (cache quantisation off).
    FLOAT = "float"
    # The formats' values in the compute dtype: reads what PACKED reads, in several times the bytes;
    # the reference the packed path is checked against.
    ROUNDED = "rounded"
    # The released bytes.
    PACKED = "packed"

    @classmethod
    def of(cls, config: DeepseekV41Config) -> "KVStorage":
        if not config.cache_qdq:
            return cls.FLOAT
        return cls.PACKED if config.cache_packed else cls.ROUNDED


@dataclass(frozen=True)
class CacheFormat:
    """One of the three formats: its rounding and its byte layout; `native_unpack` is
    `unpack` in C++ (the same bits)."""

    qdq: Callable[[torch.Tensor], torch.Tensor]
    pack: Callable[[torch.Tensor], torch.Tensor]
    unpack: Callable[[torch.Tensor, int], torch.Tensor]
    row_bytes: Callable[[int], int]
    native_unpack: Callable[[torch.Tensor, int], torch.Tensor]


def _native_unpack_fp8(packed: torch.Tensor, channels: int) -> torch.Tensor:
    return torch.ops.deepwell_v41_cache.unpack_fp8(packed, channels)


def _native_unpack_nvfp4(packed: torch.Tensor, channels: int) -> torch.Tensor:
    return torch.ops.deepwell_v41_cache.unpack_e2m1(packed, channels, NVFP4_GROUP, True)


def _native_unpack_mxfp4(packed: torch.Tensor, channels: int) -> torch.Tensor:
    return torch.ops.deepwell_v41_cache.unpack_e2m1(packed, channels, MXFP4_GROUP, False)


FP8 = CacheFormat(qdq_fp8, pack_fp8, unpack_fp8, fp8_row_bytes, _native_unpack_fp8)
NVFP4 = CacheFormat(qdq_nvfp4, pack_nvfp4, unpack_nvfp4, nvfp4_row_bytes, _native_unpack_nvfp4)
MXFP4 = CacheFormat(qdq_mxfp4, pack_mxfp4, unpack_mxfp4, mxfp4_row_bytes, _native_unpack_mxfp4)


@dataclass(frozen=True)
class StoredRows:
    """Rows of `channels` values of one cache, kept in `storage`."""

    format: CacheFormat
    channels: int
    storage: KVStorage

    @property
    def entry_shape(self) -> tuple[int, ...]:
        if self.storage is KVStorage.PACKED:
            return (self.format.row_bytes(self.channels),)
        return (self.channels,)

    @property
    def dtype(self) -> torch.dtype | None:
        """The layout spec's dtype: bytes when packed, else the cache's (compute) dtype."""
        return torch.uint8 if self.storage is KVStorage.PACKED else None

    def round(self, values: torch.Tensor) -> torch.Tensor:
        """The values a step computes with (in values' dtype)."""
        return values if self.storage is KVStorage.FLOAT else self.format.qdq(values)

    def encode(self, values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        """Rows [..., channels] as the cache holds them."""
        if self.storage is KVStorage.PACKED:
            return self.format.pack(values)
        return self.round(values).to(cache_dtype)

    def rounded_and_stored(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From unrounded rows: the values a step computes with (in values' dtype) and the
        rows the cache stores; packed, the values are the bytes unpacked (as `round` gives
        them, for less work than rounding and packing apart)."""
        if self.storage is not KVStorage.PACKED:
            rounded = self.round(values)
            return rounded, rounded
        if (
            self.format is FP8
            and values.dtype in _NATIVE_PACK_DTYPES
            and values.is_cpu
            and native_rows()
        ):
            stored, unpacked = torch.ops.deepwell_v41_cache.pack_fp8(values)
            return unpacked.to(values.dtype), stored
        stored = self.format.pack(values)
        return self.format.unpack(stored, self.channels).to(values.dtype), stored

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows → their values [..., channels] in `dtype`."""
        if self.storage is KVStorage.PACKED:
            native = stored.is_cpu and native_rows()
            unpack = self.format.native_unpack if native else self.format.unpack
            return unpack(stored, self.channels).to(dtype)
        return stored.to(dtype)


# What the native window-row packing takes.
_NATIVE_PACK_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CacheStorage:
    """The three caches of the model (the draft stages' context rings are window rows)."""

    window: StoredRows
    entries: StoredRows
    index_keys: StoredRows

    @classmethod
    def of(cls, config: DeepseekV41Config) -> "CacheStorage":
        storage = KVStorage.of(config)
        return cls(
            window=StoredRows(FP8, config.head_dim, storage),
            entries=StoredRows(NVFP4, config.head_dim, storage),
            index_keys=StoredRows(MXFP4, config.index_head_dim, storage),
        )
