"""The Triton paged decode kernel against the torch backend's decode, under the interpreter."""

import pytest
import torch

from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.layers.triton.paged_attention import TritonPagedAttention


def _decode_metadata(tables: list[list[int]], lens: list[int], block: int) -> AttentionMetadata:
    block_ids = [b for t in tables for b in t]
    return AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        num_decodes=len(tables),
        decode_context_lens=lens,
        decode_blocks=block_ids,
        block_size=block,
        prefills=[],
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tables", "lens"),
    [
        (4, 4, [[2]], [5]),  # batch 1, no GQA, a partial block
        (6, 2, [[3, 7], [1], [0, 5, 9]], [32, 2, 40]),  # GQA groups of 3, ragged contexts
        # Rows 0-2 are one sequence's verify rows at consecutive positions over shared blocks.
        (8, 2, [[4, 6], [4, 6], [4, 6], [1]], [17, 18, 19, 16]),
    ],
    ids=["batch1", "gqa_ragged", "verify_rows"],
)
def test_triton_decode_equals_the_torch_decode(heads, kv_heads, tables, lens):
    torch.manual_seed(0)
    dim, block = 16, 16
    keys = torch.randn(10, kv_heads, block, dim)
    values = torch.randn(10, kv_heads, block, dim)
    q = torch.randn(len(tables), heads, dim)
    meta = _decode_metadata(tables, lens, block)
    expected = TorchPagedAttention(heads, kv_heads, dim)._decode(q, keys, values, meta)
    out = TritonPagedAttention(heads, kv_heads, dim)._decode(q, keys, values, meta)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_keys_past_a_rows_context_are_not_read():
    torch.manual_seed(1)
    keys, values = torch.randn(2, 1, 16, 8), torch.randn(2, 1, 16, 8)
    q = torch.randn(1, 2, 8)
    meta = _decode_metadata([[1]], [3], 16)
    backend = TritonPagedAttention(2, 1, 8)
    before = backend._decode(q, keys, values, meta)
    keys[1, :, 3:], values[1, :, 3:] = 1e4, float("nan")
    torch.testing.assert_close(backend._decode(q, keys, values, meta), before)
