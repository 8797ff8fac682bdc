"""A safetensors shard memory-mapped: each tensor a view of the file's bytes, not a copy.

The format: an 8-byte little-endian header length, a JSON header of name → dtype, shape and
[begin, end) data offsets counted from the end of the header, then the data. The file is
mapped copy-on-write (numpy.memmap mode "c"): its pages are the page cache's until someone
writes to them, and a page is read from disk only when a product first touches it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

# safetensors' dtype names → torch dtypes, for what a DeepSeek-V4.1 checkpoint stores.
DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}
_LENGTH_BYTES = 8
# A header larger than this is not a safetensors header (the library's own limit).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class ShardFormatError(ValueError):
    """The file is not a whole safetensors shard; the message says what is wrong."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header lists it."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


class MappedShard:
    """The tensors of one shard, viewed in place over the mapped file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        if size < _LENGTH_BYTES:
            raise ShardFormatError(f"{size} bytes is shorter than a safetensors header")
        with path.open("rb") as file:
            header_bytes = int.from_bytes(file.read(_LENGTH_BYTES), "little")
            if header_bytes > min(size - _LENGTH_BYTES, _MAX_HEADER_BYTES):
                raise ShardFormatError(
                    f"header length {header_bytes} does not fit the file's {size} bytes "
                    "(truncated, or not safetensors)"
                )
            try:
                header = json.loads(file.read(header_bytes))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ShardFormatError(f"header is not JSON: {error}") from error
        if not isinstance(header, dict):
            raise ShardFormatError("header is not a JSON object")
        self.data_start = _LENGTH_BYTES + header_bytes
        self.entries = {
            name: _entry(name, value) for name, value in header.items() if name != "__metadata__"
        }
        data_bytes = max((entry.end for entry in self.entries.values()), default=0)
        if self.data_start + data_bytes > size:
            raise ShardFormatError(
                f"its tensors need {self.data_start + data_bytes} bytes, the file has {size} "
                "(truncated)"
            )
        # Private copy-on-write: writes (there are none) would never reach the file.
        self._bytes = torch.from_numpy(numpy.memmap(path, dtype=numpy.uint8, mode="c"))

    def tensor(self, name: str) -> torch.Tensor:
        """The named tensor over the mapped bytes; copied only when its offset is not a
        multiple of its element size (a view needs aligned elements)."""
        entry = self.entries[name]
        dtype = DTYPES[entry.dtype]
        start = self.data_start + entry.begin
        raw = self._bytes[start : self.data_start + entry.end]
        if start % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).view(entry.shape)


def _entry(name: str, value: object) -> TensorEntry:
    if not isinstance(value, dict):
        raise ShardFormatError(f"header entry {name!r} is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPES:
        raise ShardFormatError(f"tensor {name!r} has dtype {dtype!r}, not one deepwell reads")
    valid_shape = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    valid_offsets = (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )
    if not (valid_shape and valid_offsets):
        raise ShardFormatError(f"header entry {name!r} has no valid shape and data_offsets")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype].itemsize:
        raise ShardFormatError(
            f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for a {dtype} of shape {shape}"
        )
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])
