"""KVStore: a directory of content-addressed KV block files, shareable by every worker.

One file per block key (header: magic, fingerprint, key, length, checksum; then the block's
tensors), and beside it the key's ring snapshot if one was taken (`<key>.ring`, its own
magic; kv/snapshots.py), each written atomically (temp file + rename). A file's mtime is its expiry time, so the
sweeper needs only `stat`. Point it at a shared file system (3FS, NFS) and every worker on
every machine reads what any of them wrote (ARCHITECTURE.md "Scale-out").
"""

import contextlib
import math
import os
import struct
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

CACHE_CLASSES = ("chat", "agent")
MAGIC = b"DWKVBLK1"
SNAPSHOT_MAGIC = b"DWKVRNG1"
SNAPSHOT_SUFFIX = ".ring"
# magic, fingerprint, key, payload length, payload crc32
HEADER = struct.Struct("<8s16s16sQI")
# A temp file older than this belongs to a writer that died mid-write.
STALE_TEMP_S = 3600.0


@dataclass(frozen=True)
class StoreConfig:
    path: str
    capacity_bytes: int
    # Seconds a block stays after its last write or hit, per traffic class (CACHE_CLASSES).
    ttl_s: dict[str, float] = field(default_factory=lambda: {"chat": 7 * 86400, "agent": 3 * 86400})

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"KV store capacity must be positive, got {self.capacity_bytes}")
        if set(self.ttl_s) != set(CACHE_CLASSES) or min(self.ttl_s.values()) <= 0:
            raise ValueError(f"KV store TTLs must be positive for {CACHE_CLASSES}: {self.ttl_s}")


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    # Truncated, corrupt or foreign files, and I/O failures: each ignored and recomputed.
    errors: int = 0
    expired: int = 0
    evicted: int = 0


class KVStore:
    def __init__(
        self,
        config: StoreConfig,
        fingerprint: bytes,
        parts: list[tuple[tuple[int, ...], torch.dtype]],
        magic: bytes = MAGIC,
        suffix: str = "",
        stats: StoreStats | None = None,
    ) -> None:
        """`parts`: shape and dtype of each tensor of one block, in file order. A ring
        snapshot store passes its own magic and file suffix, and shares the block store's
        stats (one error count)."""
        self.config = config
        self.root = Path(config.path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.parts = parts
        self.magic = magic
        self.suffix = suffix
        self.payload_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in parts)
        self.stats = stats if stats is not None else StoreStats()

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + self.suffix)

    def read(self, key: bytes, cache_class: str) -> list[torch.Tensor] | None:
        """The block stored under `key`, or None (absent, expired or invalid: never wrong)."""
        path = self.path_of(key)
        now = time.time()
        try:
            expires = path.stat().st_mtime
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except OSError:
            self.stats.errors += 1
            return None
        if expires < now:
            self.stats.expired += 1
            self.stats.misses += 1
            _unlink(path)
            return None
        try:
            tensors = self._load(path, key)
            # A hit keeps the block for another TTL of the reader's class.
            os.utime(path, (now, max(expires, now + self.config.ttl_s[cache_class])))
        except (OSError, ValueError):
            self.stats.errors += 1
            self.stats.misses += 1
            _unlink(path)
            return None
        self.stats.hits += 1
        self.stats.read_bytes += HEADER.size + self.payload_bytes
        return tensors

    def _load(self, path: Path, key: bytes) -> list[torch.Tensor]:
        with open(path, "rb") as file:
            header = file.read(HEADER.size)
            if len(header) != HEADER.size:
                raise ValueError("truncated header")
            magic, fingerprint, stored_key, length, checksum = HEADER.unpack(header)
            if magic != self.magic or fingerprint != self.fingerprint or stored_key != key:
                raise ValueError("foreign block file")
            if length != self.payload_bytes:
                raise ValueError("payload length does not match the layout")
            payload = bytearray(length)
            if file.readinto(payload) != length or file.read(1):
                raise ValueError("truncated or overlong payload")
        if zlib.crc32(payload) != checksum:
            raise ValueError("checksum mismatch")
        tensors = []
        offset = 0
        for shape, dtype in self.parts:
            count = math.prod(shape)
            tensor = torch.frombuffer(payload, dtype=dtype, count=count, offset=offset)
            tensors.append(tensor.view(shape))
            offset += count * tensor.element_size()
        return tensors

    def write(self, key: bytes, tensors: list[torch.Tensor], cache_class: str) -> None:
        """Store a block unless a valid file is already there (then extend its expiry)."""
        path = self.path_of(key)
        now = time.time()
        expires = now + self.config.ttl_s[cache_class]
        try:
            current = path.stat().st_mtime
        except FileNotFoundError:
            current = None
        except OSError:
            self.stats.errors += 1
            return
        if current is not None and current >= now:
            # Same key, same fingerprint: same content (content-addressed); just keep it.
            try:
                os.utime(path, (now, max(current, expires)))
            except OSError:
                self.stats.errors += 1
            return
        buffers = [t.contiguous().view(torch.uint8).numpy() for t in tensors]
        checksum = 0
        for buffer in buffers:
            checksum = zlib.crc32(buffer, checksum)
        length = sum(b.nbytes for b in buffers)
        temp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temp, "wb") as file:
                file.write(HEADER.pack(self.magic, self.fingerprint, key, length, checksum))
                for buffer in buffers:
                    file.write(buffer)
            os.utime(temp, (now, expires))
            os.replace(temp, path)
        except OSError:
            self.stats.errors += 1
            _unlink(temp)
            return
        self.stats.written_bytes += HEADER.size + length

    def sweep(self) -> int:
        """Delete expired files (blocks and snapshots alike), then the soonest-expiring ones
        beyond the capacity, and stale temp files; returns the bytes left."""
        now = time.time()
        blocks: list[tuple[float, int, Path]] = []
        for directory in _subdirs(self.root):
            for entry in _entries(directory):
                try:
                    stat = entry.stat()
                except OSError:
                    continue  # another worker's sweeper got there first
                path = Path(entry.path)
                if entry.name.startswith("."):
                    if stat.st_mtime < now - STALE_TEMP_S and entry.name.endswith(".tmp"):
                        _unlink(path)
                elif stat.st_mtime < now:
                    self.stats.expired += 1
                    _unlink(path)
                else:
                    blocks.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in blocks)
        blocks.sort()
        for _, size, path in blocks:
            if total <= self.config.capacity_bytes:
                break
            _unlink(path)
            self.stats.evicted += 1
            total -= size
        return total


def _subdirs(root: Path) -> list[os.DirEntry]:
    return [entry for entry in _entries(root) if entry.is_dir()]


def _entries(directory) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError:
        return []


def _unlink(path: Path) -> None:
    # Another worker may have removed it already; a file we cannot remove is still never
    # used wrongly (reads verify it), so the delete is best effort.
    with contextlib.suppress(OSError):
        path.unlink()
