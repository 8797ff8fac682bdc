"""The root of the prefix hash chain (prefix_hash.py): a fingerprint of the model, its KV
layout, block size and dtype, so a key never matches KV computed by another model or layout
(spec/deepinfer.md §1.6).
"""

import hashlib
import json
from typing import Any

import torch

from deepwell.engine.kv.layout import KVLayout
from deepwell.engine.kv.prefix_hash import KEY_BYTES

# Bytes of each weight tensor that go into the fingerprint: enough to tell checkpoints
# apart, cheap enough for a 100 GB model.
WEIGHT_SAMPLE_BYTES = 4096


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
