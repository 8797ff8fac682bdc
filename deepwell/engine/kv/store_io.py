"""StoreIO: the KV store's background threads, so the step loop never waits on files.

A writer drains a bounded queue of blocks (and ring snapshots) computed by prefill and
decode, a loader reads the stored prefix of a new prompt before it is scheduled, and a
sweeper expires and evicts.
"""

import hashlib
import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepwell.engine.args import EngineArgs
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.snapshots import SnapshotPart
from deepwell.engine.kv.store import SNAPSHOT_MAGIC, SNAPSHOT_SUFFIX, KVStore, StoreConfig

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 60.0
# Blocks waiting to be written, in bytes; beyond it new blocks are dropped (the step loop
# never blocks on a slow file system, and a dropped block is only a later miss).
MAX_PENDING_WRITE_BYTES = 1 << 30
GIB = 1 << 30


def open_store(
    args: EngineArgs,
    fingerprint: bytes | None,
    cache: KVCache,
    snapshot_parts: list[SnapshotPart] | None = None,
) -> "StoreIO | None":
    """The KV store the engine args ask for, with its threads started; None without one.
    With `snapshot_parts` it keeps ring snapshots beside the blocks."""
    if args.kv_store_path is None or fingerprint is None:
        return None
    config = StoreConfig(
        path=args.kv_store_path,
        capacity_bytes=int(args.kv_store_capacity_gib * GIB),
        ttl_s={"chat": args.kv_store_ttl_chat_s, "agent": args.kv_store_ttl_agent_s},
    )
    parts = [(tuple(t.shape[1:]), t.dtype) for t in cache.block_tensors()]
    store = KVStore(config, fingerprint, parts)
    snapshots = None
    if snapshot_parts:
        # What a snapshot holds depends on the truncation mode, not only on the model: a
        # snapshot written under another mode is foreign, while the blocks stay shared.
        digest = hashlib.blake2b(fingerprint, digest_size=len(fingerprint))
        digest.update(repr(snapshot_parts).encode())
        snapshots = KVStore(
            config,
            digest.digest(),
            [((p.num_rows, *p.entry_shape), p.dtype) for p in snapshot_parts],
            magic=SNAPSHOT_MAGIC,
            suffix=SNAPSHOT_SUFFIX,
            stats=store.stats,
        )
    return StoreIO(store, snapshots)


class StoreIO:
    def __init__(
        self,
        store: KVStore,
        snapshots: KVStore | None = None,
        sweep_interval_s: float = SWEEP_INTERVAL_S,
    ) -> None:
        self.store = store
        self.snapshots = snapshots
        self.dropped_writes = 0
        self._writes: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="deepwell-kv-load")
        self._stop = threading.Event()
        # Bytes in the store as of the last sweep plus what was written since.
        self._estimated_bytes = 0
        self._sweep_now = threading.Event()
        self._writer = threading.Thread(
            target=self._write_loop, name="deepwell-kv-write", daemon=True
        )
        self._sweeper = threading.Thread(
            target=self._sweep_loop, args=(sweep_interval_s,), name="deepwell-kv-sweep", daemon=True
        )
        self._writer.start()
        self._sweeper.start()

    def load(
        self,
        keys: list[bytes],
        cache_class: str,
        snapshot_keys: list[tuple[int, bytes]] = (),
    ) -> Future:
        """Read the stored run of `keys` (stopping at the first miss), then the first
        stored snapshot of `snapshot_keys` ((blocks of `keys` it needs, snapshot key), best
        first) whose blocks are there, off the step loop.

        The future holds ([(key, block tensors)], {snapshot key: tensors}), both possibly
        empty.
        """
        return self._loader.submit(self._load, keys, cache_class, snapshot_keys)

    def _load(
        self, keys: list[bytes], cache_class: str, snapshot_keys: list[tuple[int, bytes]]
    ) -> tuple[list[tuple[bytes, list[torch.Tensor]]], dict[bytes, list[torch.Tensor]]]:
        found = []
        for key in keys:
            tensors = self.store.read(key, cache_class)
            if tensors is None:
                break
            found.append((key, tensors))
        for needed, key in snapshot_keys:
            if needed <= len(found):
                tensors = self.snapshots.read(key, cache_class)
                if tensors is not None:
                    return found, {key: tensors}
        return found, {}

    def save(self, blocks: list[tuple[bytes, list[torch.Tensor]]], cache_class: str) -> None:
        """Queue blocks (tensors the caller no longer touches) for writing."""
        for key, tensors in blocks:
            self._queue(self.store, key, tensors, cache_class)

    def save_snapshot(self, key: bytes, tensors: list[torch.Tensor], cache_class: str) -> None:
        """Queue a ring snapshot (kv/snapshots.py) for writing beside its block."""
        self._queue(self.snapshots, key, tensors, cache_class)

    def _queue(
        self, store: KVStore, key: bytes, tensors: list[torch.Tensor], cache_class: str
    ) -> None:
        size = store.payload_bytes
        with self._pending_lock:
            if self._pending_bytes + size > MAX_PENDING_WRITE_BYTES:
                self.dropped_writes += 1
                return
            self._pending_bytes += size
        self._writes.put((store, key, tensors, cache_class))

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._writes.join()

    def close(self) -> None:
        self.flush()
        self._stop.set()
        self._sweep_now.set()
        self._writes.put(None)
        self._writer.join()
        self._sweeper.join()
        self._loader.shutdown(cancel_futures=True)

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                store, key, tensors, cache_class = item
                before = store.stats.written_bytes
                store.write(key, tensors, cache_class)
                self._estimated_bytes += store.stats.written_bytes - before
                if self._estimated_bytes > store.config.capacity_bytes:
                    self._sweep_now.set()
            finally:
                if item is not None:
                    with self._pending_lock:
                        self._pending_bytes -= item[0].payload_bytes
                self._writes.task_done()

    def _sweep_loop(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                self._estimated_bytes = self.store.sweep()
            except Exception:  # a sweep failure must not end sweeping for good
                logger.exception("KV store sweep failed")
            self._sweep_now.wait(interval_s)
            self._sweep_now.clear()
