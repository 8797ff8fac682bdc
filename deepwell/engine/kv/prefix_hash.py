"""The prefix hash chain: a full block's key covers its tokens and every token before it.

Torch-free, so the HTTP process keys prompts as the engines do (serve/cluster/prefix_index.py)
from the chain's root the workers report (kv/prefix.py `fingerprint`).
"""

import hashlib
from collections.abc import Sequence

KEY_BYTES = 16

# An image's span in the prompt: (first position, end position, content hash). All its
# positions hold the same image token, so the hash is what tells two images apart.
ImageSpan = tuple[int, int, str]


def block_key(parent: bytes, token_ids: list[int], image_hashes: Sequence[str] = ()) -> bytes:
    """`image_hashes`: the content hashes of the images whose spans reach into the block."""
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    for content_hash in image_hashes:
        digest.update(b"\0image:" + content_hash.encode())
    return digest.digest()


def chain_keys(
    parent: bytes,
    token_ids: list[int],
    block_size: int,
    start_block: int,
    num_blocks: int,
    image_spans: Sequence[ImageSpan] = (),
) -> list[bytes]:
    """Keys of blocks [start_block, num_blocks) of `token_ids`; `parent` is the key before."""
    keys = []
    for index in range(start_block, num_blocks):
        start, end = index * block_size, (index + 1) * block_size
        images = [h for first, last, h in image_spans if first < end and last > start]
        parent = block_key(parent, token_ids[start:end], images)
        keys.append(parent)
    return keys


def prompt_block_keys(
    root: bytes, token_ids: list[int], block_size: int, image_spans: Sequence[ImageSpan] = ()
) -> list[bytes]:
    """Keys of the prompt's full blocks, from the chain's `root`; `image_spans` (the prompt's
    images) key blocks apart that differ only in an image."""
    return chain_keys(root, token_ids, block_size, 0, len(token_ids) // block_size, image_spans)
