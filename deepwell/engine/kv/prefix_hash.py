"""The prefix hash chain: a full block's key covers its tokens and every token before it.

Torch-free, so the HTTP process keys prompts as the engines do (serve/cluster/prefix_index.py)
from the chain's root the workers report (kv/prefix.py `fingerprint`).
"""

import hashlib

KEY_BYTES = 16


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


def prompt_block_keys(root: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """Keys of the prompt's full blocks, from the chain's `root`."""
    return chain_keys(root, token_ids, block_size, 0, len(token_ids) // block_size)
