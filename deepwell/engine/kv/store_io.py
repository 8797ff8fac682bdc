"""StoreIO: the KV store's background threads, so the step loop never waits on files.

A writer drains a bounded queue of blocks computed by prefill and decode, a loader reads
the stored prefix of a new prompt before it is scheduled, and a sweeper expires and evicts.
"""

import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepwell.engine.args import EngineArgs
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.store import KVStore, StoreConfig

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 60.0
# Blocks waiting to be written, in bytes; beyond it new blocks are dropped (the step loop
# never blocks on a slow file system, and a dropped block is only a later miss).
MAX_PENDING_WRITE_BYTES = 1 << 30
GIB = 1 << 30


def open_store(args: EngineArgs, fingerprint: bytes | None, cache: KVCache) -> "StoreIO | None":
    """The KV store the engine args ask for, with its threads started; None without one."""
    if args.kv_store_path is None or fingerprint is None:
        return None
    config = StoreConfig(
        path=args.kv_store_path,
        capacity_bytes=int(args.kv_store_capacity_gib * GIB),
        ttl_s={"chat": args.kv_store_ttl_chat_s, "agent": args.kv_store_ttl_agent_s},
    )
    parts = [(tuple(t.shape[1:]), t.dtype) for t in cache.block_tensors()]
    return StoreIO(KVStore(config, fingerprint, parts))


class StoreIO:
    def __init__(self, store: KVStore, sweep_interval_s: float = SWEEP_INTERVAL_S) -> None:
        self.store = store
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

    def load(self, keys: list[bytes], cache_class: str) -> Future:
        """Read the stored run of `keys` (stopping at the first miss), off the step loop.

        The future holds [(key, block tensors)], possibly empty.
        """
        return self._loader.submit(self._load, keys, cache_class)

    def _load(self, keys: list[bytes], cache_class: str) -> list[tuple[bytes, list[torch.Tensor]]]:
        found = []
        for key in keys:
            tensors = self.store.read(key, cache_class)
            if tensors is None:
                break
            found.append((key, tensors))
        return found

    def save(self, blocks: list[tuple[bytes, list[torch.Tensor]]], cache_class: str) -> None:
        """Queue blocks (tensors the caller no longer touches) for writing."""
        size = self.store.payload_bytes
        for key, tensors in blocks:
            with self._pending_lock:
                if self._pending_bytes + size > MAX_PENDING_WRITE_BYTES:
                    self.dropped_writes += 1
                    continue
                self._pending_bytes += size
            self._writes.put((key, tensors, cache_class))

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
                key, tensors, cache_class = item
                before = self.store.stats.written_bytes
                self.store.write(key, tensors, cache_class)
                self._estimated_bytes += self.store.stats.written_bytes - before
                if self._estimated_bytes > self.store.config.capacity_bytes:
                    self._sweep_now.set()
            finally:
                if item is not None:
                    with self._pending_lock:
                        self._pending_bytes -= self.store.payload_bytes
                self._writes.task_done()

    def _sweep_loop(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                self._estimated_bytes = self.store.sweep()
            except Exception:  # a sweep failure must not end sweeping for good
                logger.exception("KV store sweep failed")
            self._sweep_now.wait(interval_s)
            self._sweep_now.clear()
