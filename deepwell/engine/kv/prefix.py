"""Hash-chained block keys: a full block's key covers its tokens and every token before it.

The chain starts from a fingerprint of the model, its KV layout, block size and dtype, so a
key never matches KV computed by another model or layout (spec/deepinfer.md §1.6).
"""

import hashlib
import json
from typing import Any

import torch

from deepwell.engine.kv.layout import KVLayout

KEY_BYTES = 16
# Bytes of each weight tensor that go into the fingerprint: enough to tell checkpoints
# apart, cheap enough for a 100 GB model.
WEIGHT_SAMPLE_BYTES = 4096


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return digest.digest()


def chain_keys(
    parent: bytes, token_ids: list[int], block_size: int, start_block: int, num_blocks: int
) -> list[bytes]:
    """Keys of blocks [start_block, num_blocks) of `token_ids`; `parent` is the key before."""
    keys = []
    for index in range(start_block, num_blocks):
        parent = block_key(parent, token_ids[index * block_size : (index + 1) * block_size])
        keys.append(parent)
    return keys


def fingerprint(
    architecture: str,
    hf_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    layout: KVLayout,
    block_size: int,
    dtype: torch.dtype,
) -> bytes:
    """What KV content depends on besides the tokens: model, weights, layout, block size, dtype."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    meta = [architecture, hf_config, repr(layout), block_size, str(dtype)]
    digest.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        flat = tensor.detach().reshape(-1)
        count = max(1, WEIGHT_SAMPLE_BYTES // tensor.element_size())
        digest.update(flat[:count].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.digest()
