"""Batch-invariant attention: a row's output bits are the same whether it runs as a decode,
alone or beside others, or inside prefill chunks of any length; and the kernel property
that layout rests on holds on this machine."""

import pytest
import torch
import torch.nn.functional as F

from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.batch_invariant import (
    MIN_PRODUCT_ROWS,
    BatchInvariantAttention,
    tile_queries,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 32  # SmolLM2's heads, the tests' block size


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("inner", "outer"), [(HEAD_DIM, BLOCK), (128, HEAD_DIM)])
def test_a_product_row_has_the_same_bits_at_any_row_count_and_place(dtype, inner, outer):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(5, KV_HEADS, 600, inner, generator=generator).to(dtype)
    other = torch.randn(5, KV_HEADS, inner, outer, generator=generator).to(dtype)
    whole = torch.matmul(rows, other)
    least = MIN_PRODUCT_ROWS[dtype]
    for count in sorted({least, 8, 9, 48, 257}):
        for first in (0, 7, 600 - count):
            part = torch.matmul(rows[:, :, first : first + count].contiguous(), other)
            assert torch.equal(part, whole[:, :, first : first + count]), (count, first)


def attend(backend, q, keys, values, spans) -> torch.Tensor:
    """Run the spans (first row, first position, rows) of one sequence whose blocks are
    0, 1, 2, ... as one step; the caches already hold every position's key and value."""
    table = list(range(keys.shape[0]))
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in spans])
    meta = AttentionMetadata(
        slot_blocks=positions // BLOCK,
        slot_offsets=positions % BLOCK,
        num_decodes=0,
        decode_context_lens=[],
        decode_block_ids=torch.empty(0, dtype=torch.long),
        decode_block_rows=torch.empty(0, dtype=torch.long),
        decode_block_padding=torch.empty(0, 1, 1, BLOCK, dtype=torch.bool),
        decode_block_ranks=torch.empty(0, dtype=torch.long),
        decode_stack_depth=1,
        decode_block_span=0,
        prefills=[],
        seq_slots=torch.full((len(positions),), -1),
        seq_starts=torch.zeros(len(positions), dtype=torch.long),
        query_tiles=tile_queries([(r, p, n, table) for r, p, n in spans], BLOCK),
    )
    k = keys[meta.slot_blocks, :, meta.slot_offsets]
    v = values[meta.slot_blocks, :, meta.slot_offsets]
    return backend.forward(q[positions], k, v, keys, values, meta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decodes_and_chunks_of_any_length_give_the_same_bits(dtype):
    torch.manual_seed(0)
    length = 90
    backend = BatchInvariantAttention(HEADS, KV_HEADS, HEAD_DIM)
    keys = torch.randn(-(-length // BLOCK), KV_HEADS, BLOCK, HEAD_DIM).to(dtype)
    values = torch.randn_like(keys)
    q = torch.randn(length, HEADS, HEAD_DIM).to(dtype)
    whole = attend(backend, q, keys, values, [(0, 0, length)])
    # Causal attention over the whole sequence, to a tolerance: the layout computes it.
    dense_keys = keys.transpose(0, 1).flatten(1, 2)[:, :length]
    dense_values = values.transpose(0, 1).flatten(1, 2)[:, :length]
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        dense_keys.float(),
        dense_values.float(),
        is_causal=True,
        enable_gqa=True,
    ).transpose(0, 1)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(whole.float(), expected, rtol=tolerance, atol=tolerance)
    # The same rows as chunks of 1, 5 and 29 rows beside each other, and as decodes: each
    # alone (its blocks scored in place) and all in one step (gathered).
    chunked = attend(backend, q, keys, values, [(0, 0, 1), (1, 1, 5), (6, 6, 29), (35, 35, 55)])
    assert torch.equal(chunked, whole)
    decodes = attend(backend, q, keys, values, [(p, p, 1) for p in range(length)])
    assert torch.equal(decodes, whole)
    for position in (0, 31, 32, 89):
        alone = attend(backend, q, keys, values, [(0, position, 1)])
        assert torch.equal(alone[0], whole[position])
