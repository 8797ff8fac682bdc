"""The front end's record of which prompt blocks each worker holds, keyed as the engine keys them.

The keys are the engine's hash chain (`deepwell.engine.kv.prefix.block_key`), rooted in
the model fingerprint the worker reported; the HTTP process must not import torch, so the
five lines of the chain are repeated here and a test checks they agree with the engine's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

KEY_BYTES = 16


def prompt_block_keys(root: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """Keys of the prompt's full blocks, each covering its tokens and every token before."""
    keys = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        digest.update(
            b"".join(t.to_bytes(4, "little") for t in token_ids[start : start + block_size])
        )
        parent = digest.digest()
        keys.append(parent)
    return keys


class WorkerPrefixes:
    """Block keys recently sent to one worker, least recently used first.

    The worker caches a prompt's blocks when it computes them and evicts the least
    recently used when its pool runs short; capping the record at the worker's pool size
    with the same order keeps it close to what the worker holds.
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

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
