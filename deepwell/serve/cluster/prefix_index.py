"""The front end's record of which prompt blocks each worker holds, keyed as the engine keys them.

The keys are the engine's hash chain (`deepwell.engine.kv.prefix_hash`), rooted in the model
fingerprint the worker reported.
"""

from __future__ import annotations

from collections import OrderedDict


class WorkerPrefixes:
    """Block keys recently sent to one worker, least recently used first.

    The worker caches a prompt's blocks when it computes them and evicts the least
    recently used when its pool runs short; capping the record at the worker's pool size
    with the same order bounds it, and the keys the worker reports evicted (`forget`)
    keep it close to what the worker holds.
    """

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def hit_blocks(self, keys: list[bytes]) -> int:
        """Leading blocks of `keys` the worker holds."""
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            count += 1
        return count

    def record(self, keys: list[bytes], capacity: int) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > max(capacity, 0):
            self._keys.popitem(last=False)

    def forget(self, keys: list[bytes]) -> None:
        """Drop keys the worker reports evicted: under memory pressure it holds fewer
        blocks than its pool, so the capacity alone overstates its hits."""
        for key in keys:
            self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
